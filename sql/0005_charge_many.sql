-- Coalesced checks: many charges in one call, one transaction, one commit.
--
-- mcpbg_charge_many decides each check as mcpbg_charge would, in arrival order,
-- each seeing the ones before it, but reads each counter once, keeps the running
-- totals in arrays, and writes each counter once at the end: a hot counter costs
-- one lock, one read and one write per batch, not per check. The body is a fixed
-- handful of set-based statements whatever the number of limits (mcpbg_charge runs
-- several statements per counter), so it is also the serial path. Leases and wait
-- tickets stay with mcpbg_charge (the client sends those alone).
-- The counters are collected in one pass over the ops and read in one query; every
-- per-counter array starts at the first counter, so the writes' unnest keeps each
-- counter's expiry beside it whichever counters a batch leaves unwritten. The
-- operation markers are read only when the batch has any (inline mode).
--
-- Locks: every counter and operation marker of the batch, all at once, in the one
-- fixed order (mcpbg_lock), before anything is read: no deadlock with any other call.
--
-- Per check c (arrays by check): p_event_ids[c] ('' commits inline), p_op_ids[c]
-- ('' or the operation id of an inline charge), p_want_used[c], p_resolve[c], and
-- p_nops[c] ops; the ops of every check follow each other in the per-op arrays,
-- whose meaning is mcpbg_charge's. Returns one bigint[] per check, in order, each
-- exactly what mcpbg_charge returns for it ({-1} for every check when the epoch is
-- required and missing).
CREATE OR REPLACE FUNCTION mcpbg_charge_many(
    p_require_epoch boolean,
    p_event_ids text[], p_op_ids text[], p_want_used boolean[], p_resolve boolean[],
    p_nops integer[],
    p_keys text[], p_amounts bigint[], p_caps bigint[], p_enforce boolean[],
    p_expire double precision[],
    p_has_ref boolean[], p_caps_keys text[], p_fields text[], p_value_caps bigint[],
    p_plan_fields text[], p_plan_caps text[], p_file_plans text[])
RETURNS SETOF bigint[] LANGUAGE plpgsql
-- One plan for the whole call, made once per session: re-planning its statements on
-- every call (the plan cache's custom plans) cost more than running them.
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    big constant bigint := 9007199254740991;  -- counters.MAX_COUNTER
    now_s double precision := mcpbg_now();
    now_ms bigint := floor(now_s * 1000)::bigint;
    nchecks integer := coalesce(array_length(p_nops, 1), 0);
    -- per distinct counter: key, running committed / in-flight, grant, the deltas to
    -- write, expiry to write, whether its row has ended, whether it is written
    ks text[];
    kc bigint[];
    kf bigint[];
    kg bigint[];
    dc bigint[];
    df bigint[];
    kexp double precision[];
    kend boolean[];
    kdirty boolean[];
    ix integer[] := '{}';  -- per op: its counter's position in ks
    ops text[];  -- the operation ids of the batch
    seen text[];   -- operation ids already counted
    runtime boolean[];  -- per op: whether its (caps key, field) has a run-time cap row
    new_ops text[] := '{}';
    pk text[] := '{}';  -- in-flight entries to add: key, event id, amount
    pe text[] := '{}';
    pa bigint[] := '{}';
    used bigint[];
    caps bigint[];
    c integer;
    j integer;
    i integer;
    x integer;
    n integer;
    base integer := 0;
    inline boolean;
    refused integer;
    bad integer;
    wrote boolean;
    cap bigint;
    amt bigint;
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        FOR c IN 1 .. nchecks LOOP
            RETURN NEXT ARRAY[-1]::bigint[];
        END LOOP;
        RETURN;
    END IF;
    ops := array_remove(p_op_ids, '');
    IF cardinality(ops) > 0 THEN
        PERFORM mcpbg_lock(p_keys || ARRAY(SELECT 'mcpbg:v1:_op:' || o FROM unnest(ops) AS o));
    ELSE
        PERFORM mcpbg_lock(p_keys);
    END IF;
    -- Each distinct counter once, in first-seen order; ix: each op's counter.
    ks := '{}';
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        x := array_position(ks, p_keys[i]);
        IF x IS NULL THEN
            ks := ks || p_keys[i];
            x := cardinality(ks);
        END IF;
        ix[i] := x;
    END LOOP;
    SELECT array_agg(coalesce(t.committed, 0) ORDER BY u.ord),
           array_agg(coalesce(t.in_flight, 0) ORDER BY u.ord),
           array_agg(coalesce(t.grant_amount, 0) ORDER BY u.ord),
           array_agg(coalesce(t.expire_at <= now_s, false) ORDER BY u.ord)
      INTO kc, kf, kg, kend
      FROM unnest(ks) WITH ORDINALITY AS u(key, ord)
      LEFT JOIN mcpbg_counter AS t ON t.key = u.key;
    -- An ended counter reads as absent (mcpbg_drop_ended; deleted below). Every array
    -- is filled from its first counter on, so the writes' unnest keeps them in step.
    FOR x IN 1 .. cardinality(ks) LOOP
        IF kend[x] THEN
            kc[x] := 0;
            kf[x] := 0;
            kg[x] := 0;
        END IF;
        dc[x] := 0;
        df[x] := 0;
        kexp[x] := 0;
        kdirty[x] := false;
    END LOOP;
    -- Which resolved ops have a run-time cap row, read in one statement: an op with
    -- none, no value cap and no plans has its policy's cap (mcpbg_effective_cap's
    -- answer) without a call per op, most of a batch's time per check otherwise.
    IF true = ANY(p_resolve) THEN
        SELECT array_agg(EXISTS (SELECT 1 FROM mcpbg_cap AS r
                                  WHERE r.caps_key = u.k AND r.field = u.f) ORDER BY u.i)
          INTO runtime
          FROM unnest(p_caps_keys, p_fields) WITH ORDINALITY AS u(k, f, i);
    END IF;
    seen := '{}';
    IF cardinality(ops) > 0 THEN
        -- (+ 0: by id, whatever the one plan of the session was made from; the
        -- expiry index would read every live marker)
        SELECT coalesce(array_agg(o.op_id), '{}') INTO seen FROM mcpbg_op AS o
         WHERE o.op_id = ANY(ops) AND o.expire_ms + 0 > now_ms;
    END IF;
    FOR c IN 1 .. nchecks LOOP
        n := p_nops[c];
        IF p_op_ids[c] <> '' AND p_op_ids[c] = ANY(seen) THEN
            base := base + n;
            RETURN NEXT ARRAY[0]::bigint[];  -- a replay of a counted charge changes nothing
            CONTINUE;
        END IF;
        inline := p_event_ids[c] = '' OR p_op_ids[c] <> '';
        used := '{}';
        caps := '{}';
        refused := 0;
        bad := 0;
        -- Exactness first, then the refusal, then whether the admitted amounts stay exact.
        FOR j IN 1 .. n LOOP
            i := base + j;
            x := ix[i];
            IF NOT (abs(kc[x]) <= big AND abs(kf[x]) <= big AND abs(kc[x] + kf[x]) <= big) THEN
                bad := j;
                EXIT;
            END IF;
            used[j] := kc[x] + kf[x];
            cap := p_caps[i];
            IF p_resolve[c] THEN
                IF p_has_ref[i] THEN
                    IF p_fields[i] <> '' AND (runtime[i] OR p_value_caps[i] IS NOT NULL
                                              OR p_plan_caps[i] <> '') THEN
                        cap := mcpbg_effective_cap(p_caps_keys[i], p_fields[i], p_caps[i],
                            p_value_caps[i], p_plan_fields[i], p_plan_caps[i], p_file_plans[i],
                            now_s);
                    END IF;
                    cap := cap + kg[x];
                END IF;
                caps[j] := cap;
            END IF;
            IF refused = 0 AND p_enforce[i] AND used[j] + greatest(p_amounts[i], 1) > cap THEN
                refused := j;
            END IF;
        END LOOP;
        IF bad = 0 AND refused = 0 THEN
            FOR j IN 1 .. n LOOP
                i := base + j;
                x := ix[i];
                amt := p_amounts[i];
                IF inline AND NOT (abs(kc[x] + amt) <= big AND abs(kc[x] + amt + kf[x]) <= big)
                   OR NOT inline AND NOT (abs(kf[x] + amt) <= big
                                          AND abs(kc[x] + kf[x] + amt) <= big) THEN
                    bad := j;
                    EXIT;
                END IF;
            END LOOP;
        END IF;
        IF bad > 0 THEN
            RETURN NEXT ARRAY[-2, bad]::bigint[];
        ELSIF refused > 0 THEN
            IF p_want_used[c] THEN
                RETURN NEXT ARRAY[refused]::bigint[] || used || caps;
            ELSE
                RETURN NEXT ARRAY[refused]::bigint[];
            END IF;
        ELSE
            wrote := false;
            FOR j IN 1 .. n LOOP
                i := base + j;
                amt := p_amounts[i];
                CONTINUE WHEN amt = 0;
                x := ix[i];
                IF inline THEN
                    kc[x] := kc[x] + amt;
                    dc[x] := dc[x] + amt;
                ELSE
                    kf[x] := kf[x] + amt;
                    df[x] := df[x] + amt;
                    pk := pk || ks[x];
                    pe := pe || p_event_ids[c];
                    pa := pa || amt;
                END IF;
                kexp[x] := p_expire[i];  -- the last charge's expiry, as mcpbg_add repairs it
                kdirty[x] := true;
                wrote := true;
            END LOOP;
            IF wrote AND p_op_ids[c] <> '' THEN
                new_ops := new_ops || p_op_ids[c];
                seen := seen || p_op_ids[c];
            END IF;
            IF p_want_used[c] THEN
                RETURN NEXT ARRAY[0]::bigint[] || used || caps;
            ELSE
                RETURN NEXT ARRAY[0]::bigint[];
            END IF;
        END IF;
        base := base + n;
    END LOOP;
    -- The writes: each counter once, in the order of its key (as the locks).
    IF true = ANY(kend) THEN
        DELETE FROM mcpbg_pending AS p USING mcpbg_counter AS t
         WHERE t.key = ANY(ks) AND t.expire_at + 0 <= now_s AND p.key = t.key;
        DELETE FROM mcpbg_counter AS t WHERE t.key = ANY(ks) AND t.expire_at + 0 <= now_s;
    END IF;
    IF true = ANY(kdirty) THEN
        INSERT INTO mcpbg_counter AS t (key, committed, in_flight, expire_at)
        SELECT u.k, u.c, u.f, u.e FROM unnest(ks, dc, df, kexp, kdirty) AS u(k, c, f, e, d)
         WHERE u.d ORDER BY u.k
        ON CONFLICT (key) DO UPDATE
        SET committed = t.committed + excluded.committed,
            in_flight = t.in_flight + excluded.in_flight, expire_at = excluded.expire_at;
    END IF;
    IF array_length(pk, 1) > 0 THEN
        INSERT INTO mcpbg_pending AS p (key, event_id, amount)
        SELECT u.k, u.e, sum(u.a)::bigint FROM unnest(pk, pe, pa) AS u(k, e, a)
         GROUP BY u.k, u.e ORDER BY u.k, u.e
        ON CONFLICT (key, event_id) DO UPDATE SET amount = p.amount + excluded.amount;
    END IF;
    IF array_length(new_ops, 1) > 0 THEN
        INSERT INTO mcpbg_op AS o (op_id, expire_ms)
        SELECT DISTINCT u.o, now_ms + 900000 FROM unnest(new_ops) AS u(o)
        ON CONFLICT (op_id) DO UPDATE SET expire_ms = excluded.expire_ms;
    END IF;
    RETURN;
END $$;
