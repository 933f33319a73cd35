-- Bounds on the projection and on run-time changes (mcp_budget_governor/bounds.py):
-- mcpbg_apply and mcpbg_apply_change as in 0002, with the sums checked before they
-- are added (counters.apply_problem, counters.grant_problem; lua/apply.lua and
-- lua/change.lua make the same tests). A refused event rolls back the whole call and
-- names its offset, so the client dead-letters it and applies the rest.

CREATE OR REPLACE FUNCTION mcpbg_apply_change(
    p_kind text, p_key text, p_field text, p_amount bigint, p_until bigint, p_plan text,
    p_why text, p_now double precision) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    IF p_kind = 'cap_set' THEN
        INSERT INTO mcpbg_cap AS k (caps_key, field, cap, until, why)
        VALUES (p_key, p_field, p_amount, p_until, p_why)
        ON CONFLICT (caps_key, field) DO UPDATE
        SET cap = excluded.cap, until = excluded.until, why = excluded.why;
    ELSIF p_kind = 'cap_unset' THEN
        DELETE FROM mcpbg_cap WHERE caps_key = p_key AND field = p_field;
    ELSIF p_kind = 'plan_assigned' THEN
        IF p_plan = '-' THEN
            DELETE FROM mcpbg_plan WHERE field = p_field;
        ELSE
            INSERT INTO mcpbg_plan AS a (field, plan) VALUES (p_field, p_plan)
            ON CONFLICT (field) DO UPDATE SET plan = excluded.plan;
        END IF;
    ELSIF p_kind IN ('granted', 'reset') THEN
        IF p_until > p_now THEN
            PERFORM mcpbg_drop_ended(p_key, p_now);
            IF p_kind = 'granted' THEN
                SELECT grant_amount INTO g FROM mcpbg_counter WHERE key = p_key;
                g := coalesce(g, 0);
                IF g::numeric + p_amount > 9007199254740991 THEN
                    RAISE EXCEPTION 'mcpbg change: refused: %: grant % + % would leave the exact range (at most 9007199254740991)', p_key, g, p_amount;
                END IF;
            END IF;
            INSERT INTO mcpbg_counter AS t (key, grant_amount, why, expire_at)
            VALUES (p_key, p_amount, p_why, p_until)
            ON CONFLICT (key) DO UPDATE
            SET grant_amount = CASE WHEN p_kind = 'granted' THEN t.grant_amount + p_amount
                                    ELSE p_amount END,
                why = excluded.why, expire_at = excluded.expire_at;
        END IF;
    ELSE
        RAISE EXCEPTION 'mcpbg change: unknown kind %', p_kind;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION mcpbg_apply(
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
    had_wm boolean;
    fresh boolean;
    n_applied integer := 0;
    ci integer := 0;
    xi integer := 0;
    e integer;
    j integer;
    k text;
    pend bigint;
    cnt integer;
    cc bigint;
    ff bigint;
    gg bigint;
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        RETURN -1;
    END IF;
    FOREACH k IN ARRAY coalesce(p_ckeys, '{}') LOOP
        IF NOT mcpbg_counter_key_ok(k) THEN
            RAISE EXCEPTION 'mcpbg apply: refused the batch: % is not a counter key', k;
        END IF;
    END LOOP;
    FOREACH k IN ARRAY coalesce(p_xkeys, '{}') LOOP
        IF NOT (mcpbg_counter_key_ok(k) OR mcpbg_change_key_ok(k)) THEN
            RAISE EXCEPTION 'mcpbg apply: refused the batch: % is not a counter key', k;
        END IF;
    END LOOP;
    PERFORM mcpbg_lock(('mcpbg:v1:_applied:' || p_partition) || coalesce(p_ckeys, '{}')
                       || coalesce(p_xkeys, '{}'));
    SELECT w.applied INTO wm FROM mcpbg_watermark AS w WHERE w.partition = p_partition;
    had_wm := FOUND;
    wm := coalesce(wm, -1);
    FOR e IN 1 .. n LOOP
        fresh := p_offsets[e] > wm;
        IF fresh THEN
            wm := p_offsets[e];
            INSERT INTO mcpbg_seen AS s (day, event_id, expire_at)
            VALUES (p_days[e], p_ids[e], p_day_expire[e])
            ON CONFLICT (day, event_id) DO UPDATE SET expire_at = excluded.expire_at
            WHERE s.expire_at <= now_s;
            GET DIAGNOSTICS cnt = ROW_COUNT;
            fresh := cnt > 0;
        END IF;
        FOR j IN 1 .. p_ncharges[e] LOOP
            ci := ci + 1;
            IF fresh THEN
                k := p_ckeys[ci];
                PERFORM mcpbg_drop_ended(k, now_s);
                DELETE FROM mcpbg_pending WHERE key = k AND event_id = p_ids[e]
                RETURNING amount INTO pend;
                IF FOUND AND pend <> 0 THEN
                    UPDATE mcpbg_counter SET in_flight = in_flight - pend WHERE key = k;
                END IF;
                IF p_cexpire[ci] > now_s THEN
                    -- counters.apply_problem: checked before the add; a refusal rolls
                    -- the whole call back, naming the event for the client.
                    SELECT t.committed, t.in_flight INTO cc, ff FROM mcpbg_counter AS t
                    WHERE t.key = k;
                    cc := coalesce(cc, 0);
                    ff := coalesce(ff, 0);
                    IF abs(cc::numeric + p_camounts[ci]) > 9007199254740991 THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: committed % + % would leave the exact range (at most 9007199254740991)',
                            p_offsets[e], k, cc, p_camounts[ci];
                    END IF;
                    IF p_camounts[ci] < 0 AND cc::numeric + ff + p_camounts[ci] < 0 THEN
                        RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: % would take its spend (%) below zero', p_offsets[e], k, p_camounts[ci], cc + ff;
                    END IF;
                    PERFORM mcpbg_add(k, p_camounts[ci], '', p_cexpire[ci]);
                END IF;
            END IF;
        END LOOP;
        FOR j IN 1 .. p_nchanges[e] LOOP
            xi := xi + 1;
            IF fresh AND p_kinds[xi] = 'granted' AND p_xuntils[xi] > now_s THEN
                SELECT t.grant_amount INTO gg FROM mcpbg_counter AS t
                WHERE t.key = p_xkeys[xi] AND t.expire_at > now_s;
                gg := coalesce(gg, 0);
                IF gg::numeric + p_xamounts[xi] > 9007199254740991 THEN
                    RAISE EXCEPTION 'mcpbg apply: refused event at offset %: %: grant % + % would leave the exact range (at most 9007199254740991)',
                        p_offsets[e], p_xkeys[xi], gg, p_xamounts[xi];
                END IF;
            END IF;
            IF fresh THEN
                PERFORM mcpbg_apply_change(p_kinds[xi], p_xkeys[xi], p_xfields[xi],
                    p_xamounts[xi], p_xuntils[xi], p_xplans[xi], p_xwhys[xi], now_s);
            END IF;
        END LOOP;
        IF fresh THEN
            n_applied := n_applied + 1;
        END IF;
    END LOOP;
    IF p_through > wm THEN
        wm := p_through;
    END IF;
    IF n > 0 OR p_through >= 0 THEN
        INSERT INTO mcpbg_watermark AS w (partition, applied) VALUES (p_partition, wm)
        ON CONFLICT (partition) DO UPDATE SET applied = excluded.applied;
    END IF;
    RETURN n_applied;
END $$;
