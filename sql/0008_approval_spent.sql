-- An admission's spent approvals in the ledger (events.Spent): the projection marks
-- each one-time approval spent (approval.spend_op's marker counter, committed 1 until
-- it lapses), so counters rebuilt from the ledger still refuse a second use, and an
-- admission spending a marker committed already is refused (a dead letter), naming
-- its offset as mcpbg_apply does. lua/apply.lua does the same on Redis.

-- mcpbg_apply_held with each event's spent approvals ('' none, else
-- '<one-time id>:<lapses at>,...'), checked and written first, in the same transaction.
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
