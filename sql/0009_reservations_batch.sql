-- mcpbg_apply_held and mcpbg_apply_spent as in 0007 and 0008, faster on a batch of many
-- reservation events: the fresh ones (past the watermark, the first of their id, not
-- seen yet) are found in one query, a reservation is read once per close, and a batch
-- that spends no approval skips the spent check's loop. Same arguments, same rules.

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

CREATE OR REPLACE FUNCTION mcpbg_apply_spent(
    p_spent text[], p_roles text[], p_held text[],
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
    e integer;
    item text;
    untl bigint;
    k text;
    pend bigint;
    marks text[] := '{}';
    ids text[] := '{}';
    done text[] := '{}';
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        RETURN -1;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM unnest(p_spent) AS v WHERE v <> '') THEN
        n := 0;  -- the common batch: no approval spent, nothing to check here
    END IF;
    FOR e IN 1 .. n LOOP
        CONTINUE WHEN coalesce(p_spent[e], '') = '';
        FOREACH item IN ARRAY string_to_array(p_spent[e], ',') LOOP
            IF split_part(item, ':', 1) !~ '^[0-9a-f]{32}$' THEN
                RAISE EXCEPTION 'mcpbg apply: refused the batch: % is not a spent approval', item;
            END IF;
            marks := marks || ('mcpbg:v1:_spent:' || split_part(item, ':', 1));
        END LOOP;
    END LOOP;
    IF cardinality(marks) > 0 THEN
        -- One call, every key sorted: the hot path locks a marker with its counters.
        PERFORM mcpbg_lock(('mcpbg:v1:_applied:' || p_partition) || coalesce(p_ckeys, '{}')
                           || coalesce(p_xkeys, '{}') || marks);
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
            CONTINUE WHEN NOT fresh OR coalesce(p_spent[e], '') = '';
            FOREACH item IN ARRAY string_to_array(p_spent[e], ',') LOOP
                k := 'mcpbg:v1:_spent:' || split_part(item, ':', 1);
                untl := split_part(item, ':', 2)::bigint;
                PERFORM mcpbg_drop_ended(k, now_s);
                IF k = ANY (done) OR EXISTS (
                        SELECT 1 FROM mcpbg_counter AS t WHERE t.key = k AND t.committed >= 1) THEN
                    RAISE EXCEPTION 'mcpbg apply: refused event at offset %: approval %: spent already', p_offsets[e], split_part(item, ':', 1);
                END IF;
                done := done || k;
                DELETE FROM mcpbg_pending WHERE key = k AND event_id = p_ids[e]
                RETURNING amount INTO pend;
                IF FOUND AND pend <> 0 THEN
                    UPDATE mcpbg_counter SET in_flight = in_flight - pend WHERE key = k;
                END IF;
                IF untl + 1 > now_s THEN
                    INSERT INTO mcpbg_counter AS t (key, committed, expire_at)
                    VALUES (k, 1, untl + 1)
                    ON CONFLICT (key) DO UPDATE SET committed = t.committed + 1;
                END IF;
            END LOOP;
        END LOOP;
    END IF;
    RETURN mcpbg_apply_held(p_roles, p_held, p_partition, p_require_epoch, p_through,
        p_offsets, p_ids, p_days, p_day_expire, p_ncharges, p_nchanges, p_ckeys, p_camounts,
        p_cexpire, p_kinds, p_xkeys, p_xfields, p_xamounts, p_xuntils, p_xplans, p_xwhys);
END $$;
