-- A fixed price charged with its admission (issue 33): one charge holds the
-- in-flight amounts of two ledger events, the admission's and its cost's, each under
-- its own id, as lua/charge.lua does, so the projection moves each exactly once and
-- the call takes one round trip. The event id argument "<admission id> <cost id> <j>"
-- (counters.with_cost; ids hold no space) puts counters j.. under the cost id.
-- mcpbg_charge and mcpbg_charge_many are restated whole (released migrations stay as
-- released); what changed in each: the split, and which id each in-flight amount takes.

-- "<admission id> <cost id> <j>" read back (counters.split_cost): j counted from 1.
CREATE OR REPLACE FUNCTION mcpbg_split_cost(p_event_id text,
    OUT admission_id text, OUT cost_id text, OUT cost_from integer)
RETURNS record LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_event_id !~ '^\S+ \S+ [0-9]+$' THEN
        RAISE EXCEPTION 'mcpbg charge: expected "<event id> <cost id> <counter>", got %',
            p_event_id USING ERRCODE = '22023';
    END IF;
    admission_id := split_part(p_event_id, ' ', 1);
    cost_id := split_part(p_event_id, ' ', 2);
    cost_from := split_part(p_event_id, ' ', 3)::integer;
END $$;

-- Atomic, all-or-nothing charge over every counter a call touches (lua/charge.lua).
--
-- p_event_id  '' commits inline; else amounts go in-flight under it, or, as
--             "<admission id> <cost id> <j>" (counters.with_cost: a fixed price
--             charged with its admission), counters j.. under the cost id and the
--             ones before under the admission id
-- p_op_id     '' or the operation id of an inline charge (a replay changes nothing)
-- p_keys, p_amounts, p_caps, p_enforce, p_expire: per counter
-- p_resolve   whether each cap is resolved here (caps.py) from p_caps_keys,
--             p_fields ('' for none), p_value_caps (NULL: none), p_plan_fields,
--             p_plan_caps, p_file_plans; the grant is added; p_has_ref false for
--             an op the policy gives no CapRef (its default cap, no grant)
-- p_lease_id  '' or the lease id for the lease sets among p_keys, held p_lease_ms
-- p_ticket    '' or a waiting call's ticket "<id>/<wait ms>" (lua/lib.lua waiters_ahead):
--             a lease set with r free slots admits only a caller with fewer than r
--             live waiters ahead of it (no ticket: every waiter is ahead); a refused
--             waiting call joins the queue of every lease set of the call, an
--             admitted one leaves them
--
-- Returns {refused} or, with p_want_used, {refused, used...} (and, resolved, the
-- caps after them): refused is 0 when admitted, else the 1-based position of the
-- first refusing counter (nothing written); {-1} when the epoch is required and
-- missing; {-2, i} when counter i is or would leave the exact range.
CREATE OR REPLACE FUNCTION mcpbg_charge(
    p_event_id text, p_op_id text, p_want_used boolean, p_require_epoch boolean,
    p_keys text[], p_amounts bigint[], p_caps bigint[], p_enforce boolean[],
    p_expire double precision[],
    p_resolve boolean, p_has_ref boolean[], p_caps_keys text[], p_fields text[],
    p_value_caps bigint[], p_plan_fields text[], p_plan_caps text[], p_file_plans text[],
    p_lease_id text, p_lease_ms bigint, p_ticket text)
RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    now_ms bigint := floor(now_s * 1000)::bigint;
    n integer := coalesce(array_length(p_keys, 1), 0);
    inline boolean := p_event_id = '';
    admission_id text := p_event_id;
    cost_id text := '';
    cost_from integer := n + 1;
    leased boolean := p_lease_id <> '';
    lease_prefix constant text := 'mcpbg:v1:_lease:';
    cs bigint[] := '{}';
    fs bigint[] := '{}';
    used bigint[] := '{}';
    caps bigint[] := '{}';
    is_lease boolean[] := '{}';
    refused integer := 0;
    c bigint;
    f bigint;
    g bigint;
    cap bigint;
    i integer;
    wrote boolean := false;
    op_key text;
    waiting bigint;
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        RETURN ARRAY[-1]::bigint[];
    END IF;
    IF strpos(p_event_id, ' ') > 0 THEN
        SELECT * INTO admission_id, cost_id, cost_from FROM mcpbg_split_cost(p_event_id);
    END IF;
    IF p_op_id <> '' THEN
        op_key := 'mcpbg:v1:_op:' || p_op_id;
        PERFORM mcpbg_lock(p_keys || op_key);
        IF EXISTS (SELECT 1 FROM mcpbg_op WHERE op_id = p_op_id AND expire_ms > now_ms) THEN
            RETURN ARRAY[0]::bigint[];
        END IF;
        inline := true;
    ELSE
        PERFORM mcpbg_lock(p_keys);
    END IF;
    -- Exactness first, then the refusal, then whether the admitted amounts stay exact.
    FOR i IN 1 .. n LOOP
        is_lease[i] := leased AND left(p_keys[i], length(lease_prefix)) = lease_prefix;
        IF is_lease[i] THEN
            DELETE FROM mcpbg_lease WHERE key = p_keys[i] AND until_ms <= now_ms;
            SELECT count(*) INTO c FROM mcpbg_lease WHERE key = p_keys[i];
            f := 0;
            g := 0;
        ELSE
            PERFORM mcpbg_drop_ended(p_keys[i], now_s);
            SELECT t.committed, t.in_flight, t.grant_amount INTO c, f, g
            FROM mcpbg_counter AS t WHERE t.key = p_keys[i];
            IF NOT FOUND THEN
                c := 0;
                f := 0;
                g := 0;
            END IF;
            IF NOT mcpbg_stays_exact(c, f, 0, inline) THEN
                RETURN ARRAY[-2, i]::bigint[];
            END IF;
        END IF;
        cs[i] := c;
        fs[i] := f;
        used[i] := c + f;
        cap := p_caps[i];
        IF p_resolve THEN
            IF p_has_ref[i] THEN
                cap := mcpbg_effective_cap(p_caps_keys[i], p_fields[i], p_caps[i],
                    p_value_caps[i], p_plan_fields[i], p_plan_caps[i], p_file_plans[i], now_s) + g;
            END IF;
            caps[i] := cap;
        END IF;
        waiting := 0;
        IF is_lease[i] AND cap > used[i] THEN
            waiting := mcpbg_waiters_ahead(p_keys[i], p_ticket, cap - used[i], now_ms);
        END IF;
        IF refused = 0 AND p_enforce[i]
           AND used[i] + waiting + greatest(p_amounts[i], 1) > cap THEN
            refused := i;
        END IF;
    END LOOP;
    IF refused > 0 THEN
        IF p_ticket <> '' AND is_lease[refused] THEN  -- only a full lease set is worth waiting for
            FOR i IN 1 .. n LOOP
                IF is_lease[i] THEN
                    INSERT INTO mcpbg_wait (key, ticket, arrived_ms, until_ms)
                    VALUES (p_keys[i], p_ticket, now_ms, now_ms + mcpbg_ticket_ms(p_ticket))
                    ON CONFLICT (key, ticket) DO NOTHING;
                END IF;
            END LOOP;
        END IF;
        IF p_want_used THEN
            RETURN ARRAY[refused]::bigint[] || used || caps;
        END IF;
        RETURN ARRAY[refused]::bigint[];
    END IF;
    FOR i IN 1 .. n LOOP
        IF NOT is_lease[i] AND NOT mcpbg_stays_exact(cs[i], fs[i], p_amounts[i], inline) THEN
            RETURN ARRAY[-2, i]::bigint[];
        END IF;
    END LOOP;
    FOR i IN 1 .. n LOOP
        IF is_lease[i] THEN
            INSERT INTO mcpbg_lease AS l (key, lease_id, until_ms)
            VALUES (p_keys[i], p_lease_id, now_ms + p_lease_ms)
            ON CONFLICT (key, lease_id) DO UPDATE SET until_ms = excluded.until_ms;
            IF p_ticket <> '' THEN
                DELETE FROM mcpbg_wait WHERE key = p_keys[i] AND ticket = p_ticket;
            END IF;
        ELSIF p_amounts[i] <> 0 THEN
            PERFORM mcpbg_add(p_keys[i], p_amounts[i],
                              CASE WHEN inline THEN '' WHEN i >= cost_from THEN cost_id
                                   ELSE admission_id END, p_expire[i]);
            wrote := true;
        END IF;
    END LOOP;
    IF op_key IS NOT NULL AND wrote THEN
        INSERT INTO mcpbg_op AS o (op_id, expire_ms) VALUES (p_op_id, now_ms + 900000)
        ON CONFLICT (op_id) DO UPDATE SET expire_ms = excluded.expire_ms;
    END IF;
    IF p_want_used THEN
        RETURN ARRAY[0]::bigint[] || used || caps;
    END IF;
    RETURN ARRAY[0]::bigint[];
END $$;

-- Coalesced checks (0005_charge_many.sql says how), each check's event id as
-- mcpbg_charge takes it.
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
    admission_id text;
    cost_id text;
    cost_from integer;
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
        admission_id := p_event_ids[c];
        cost_from := n + 1;
        IF NOT inline AND strpos(admission_id, ' ') > 0 THEN
            SELECT * INTO admission_id, cost_id, cost_from FROM mcpbg_split_cost(admission_id);
        END IF;
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
                    pe := pe || CASE WHEN j >= cost_from THEN cost_id ELSE admission_id END;
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
