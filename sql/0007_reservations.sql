-- The open reservations the projection holds (counters.Holds; lua/apply.lua keeps the
-- same in mcpbg:v1:_res:<id> hashes): a reserved event's estimate per counter, until
-- its counter expires. A settlement, release or refunding recovery must draw on one
-- held, a refund within the estimate on its counter; the first closing event removes it.

CREATE TABLE mcpbg_hold (
    reservation text NOT NULL,
    key text NOT NULL,
    estimate bigint NOT NULL,
    expire_at double precision NOT NULL,
    PRIMARY KEY (reservation, key)
);
CREATE INDEX mcpbg_hold_expire ON mcpbg_hold (expire_at);

-- mcpbg_apply with each event's reservation role ('-' none, 'o' opens one under its own
-- id, 'c' draws on and closes p_held[e], '' when it names none): the roles are checked
-- and recorded first, in the same transaction, so a refusal (naming the event's offset,
-- as mcpbg_apply's) leaves nothing written. Freshness is mcpbg_apply's: an offset past
-- the watermark and an id not yet seen.
CREATE OR REPLACE FUNCTION mcpbg_apply_held(
    p_roles text[], p_held text[],
    p_partition text, p_require_epoch boolean, p_through bigint,
    p_offsets bigint[], p_ids text[], p_days text[], p_day_expire double precision[],
    p_ncharges integer[], p_nchanges integer[],
    p_ckeys text[], p_camounts bigint[], p_cexpire double precision[],
    p_kinds text[], p_xkeys text[], p_xfields text[], p_xamounts bigint[], p_xuntils bigint[],
    p_xplans text[], p_xwhys text[])
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    wm bigint;
    ev record;
    j integer;
    est bigint;
    held jsonb;
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        RETURN -1;
    END IF;
    IF 'o' = ANY (p_roles) OR 'c' = ANY (p_roles) THEN
        PERFORM mcpbg_lock(('mcpbg:v1:_applied:' || p_partition) || coalesce(p_ckeys, '{}')
                           || coalesce(p_xkeys, '{}'));
        DELETE FROM mcpbg_hold WHERE ctid IN (
            SELECT ctid FROM mcpbg_hold WHERE expire_at <= now_s LIMIT 100
            FOR UPDATE SKIP LOCKED);
        SELECT w.applied INTO wm FROM mcpbg_watermark AS w WHERE w.partition = p_partition;
        wm := coalesce(wm, -1);
        -- Offsets rise through a batch, so an event is fresh when it is past the
        -- watermark, the first of its id past it, and its id is not seen yet: what
        -- mcpbg_apply finds one event at a time. ci: the event's charges start after.
        FOR ev IN
            SELECT x.* FROM (
                SELECT u.ord, u.off, u.id, u.dy, u.r, u.h, u.nc,
                       coalesce(sum(u.nc) OVER (ORDER BY u.ord ROWS BETWEEN UNBOUNDED
                                                PRECEDING AND 1 PRECEDING), 0) AS ci,
                       count(*) OVER (PARTITION BY u.id, u.off > wm ORDER BY u.ord) AS nth
                FROM unnest(p_offsets, p_ids, p_days, p_roles, p_held, p_ncharges)
                     WITH ORDINALITY AS u(off, id, dy, r, h, nc, ord)) AS x
            WHERE x.r <> '-' AND x.off > wm AND x.nth = 1 AND NOT EXISTS (
                SELECT 1 FROM mcpbg_seen AS s
                WHERE s.day = x.dy AND s.event_id = x.id AND s.expire_at > now_s)
            ORDER BY x.ord
        LOOP
            IF ev.r = 'c' THEN
                SELECT jsonb_object_agg(h.key, h.estimate) INTO held FROM mcpbg_hold AS h
                WHERE h.reservation = ev.h AND h.expire_at > now_s;
                FOR j IN ev.ci + 1 .. ev.ci + ev.nc LOOP
                    CONTINUE WHEN p_cexpire[j] <= now_s;
                    IF ev.h = '' THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: data.reservation: names no reservation (its money moves only against one)', ev.off;
                    END IF;
                    IF held IS NULL THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: reservation %: not one the ledger holds (never made, closed already or expired)', ev.off, ev.h;
                    END IF;
                    CONTINUE WHEN p_camounts[j] >= 0;
                    est := (held ->> p_ckeys[j])::bigint;
                    IF est IS NULL THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: reservation % holds no estimate on this counter', ev.off, p_ckeys[j], ev.h;
                    END IF;
                    IF -p_camounts[j] > est THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: refund % is more than reservation %''s estimate (%)', ev.off, p_ckeys[j], -p_camounts[j], ev.h, est;
                    END IF;
                END LOOP;
                IF held IS NOT NULL THEN
                    DELETE FROM mcpbg_hold WHERE reservation = ev.h;
                END IF;
            ELSE
                INSERT INTO mcpbg_hold AS t (reservation, key, estimate, expire_at)
                SELECT ev.id, p_ckeys[g.i], p_camounts[g.i], p_cexpire[g.i]
                FROM generate_series(ev.ci + 1, ev.ci + ev.nc) AS g(i)
                WHERE p_cexpire[g.i] > now_s
                ON CONFLICT (reservation, key) DO UPDATE
                SET estimate = excluded.estimate, expire_at = excluded.expire_at;
            END IF;
        END LOOP;
    END IF;
    RETURN mcpbg_apply(p_partition, p_require_epoch, p_through, p_offsets, p_ids, p_days,
        p_day_expire, p_ncharges, p_nchanges, p_ckeys, p_camounts, p_cexpire, p_kinds, p_xkeys,
        p_xfields, p_xamounts, p_xuntils, p_xplans, p_xwhys);
END $$;
