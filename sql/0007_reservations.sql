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
    n integer := coalesce(array_length(p_offsets, 1), 0);
    wm bigint;
    fresh boolean;
    ci integer := 0;
    e integer;
    j integer;
    est bigint;
    held integer;
    live integer;
    ids text[] := '{}';
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
        FOR e IN 1 .. n LOOP
            fresh := p_offsets[e] > wm;
            IF fresh THEN
                wm := p_offsets[e];
                fresh := NOT p_ids[e] = ANY (ids) AND NOT EXISTS (
                    SELECT 1 FROM mcpbg_seen AS s
                    WHERE s.day = p_days[e] AND s.event_id = p_ids[e] AND s.expire_at > now_s);
                ids := ids || p_ids[e];
            END IF;
            IF fresh AND p_roles[e] = 'c' THEN
                SELECT count(*) INTO held FROM mcpbg_hold AS h
                WHERE h.reservation = p_held[e] AND h.expire_at > now_s;
                live := 0;
                FOR j IN ci + 1 .. ci + p_ncharges[e] LOOP
                    CONTINUE WHEN p_cexpire[j] <= now_s;
                    live := live + 1;
                    IF p_held[e] = '' THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: data.reservation: names no reservation (its money moves only against one)', p_offsets[e];
                    END IF;
                    IF held = 0 THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: reservation %: not one the ledger holds (never made, closed already or expired)', p_offsets[e], p_held[e];
                    END IF;
                    CONTINUE WHEN p_camounts[j] >= 0;
                    SELECT h.estimate INTO est FROM mcpbg_hold AS h
                    WHERE h.reservation = p_held[e] AND h.key = p_ckeys[j];
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: reservation % holds no estimate on this counter', p_offsets[e], p_ckeys[j], p_held[e];
                    END IF;
                    IF -p_camounts[j] > est THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: refund % is more than reservation %''s estimate (%)', p_offsets[e], p_ckeys[j], -p_camounts[j], p_held[e], est;
                    END IF;
                END LOOP;
                DELETE FROM mcpbg_hold WHERE reservation = p_held[e];
            ELSIF fresh AND p_roles[e] = 'o' THEN
                FOR j IN ci + 1 .. ci + p_ncharges[e] LOOP
                    CONTINUE WHEN p_cexpire[j] <= now_s;
                    INSERT INTO mcpbg_hold (reservation, key, estimate, expire_at)
                    VALUES (p_ids[e], p_ckeys[j], p_camounts[j], p_cexpire[j])
                    ON CONFLICT (reservation, key) DO UPDATE
                    SET estimate = excluded.estimate, expire_at = excluded.expire_at;
                END LOOP;
            END IF;
            ci := ci + p_ncharges[e];
        END LOOP;
    END IF;
    RETURN mcpbg_apply(p_partition, p_require_epoch, p_through, p_offsets, p_ids, p_days,
        p_day_expire, p_ncharges, p_nchanges, p_ckeys, p_camounts, p_cexpire, p_kinds, p_xkeys,
        p_xfields, p_xamounts, p_xuntils, p_xplans, p_xwhys);
END $$;
