-- The counter functions: each call is one atomic step, one round trip.
--
-- Concurrency: every function first takes a transaction-scoped advisory lock per
-- key it reads or writes (counters, lease sets, operation markers, watermarks,
-- caps), all of them in one fixed order (ascending hashtext of the key, in the
-- lock class 1835233378, 'mcpb'), then reads and writes. A lock is held until the
-- call's transaction ends, so two calls sharing any key run one after the other,
-- and since every call takes its locks in the same order, no two calls can wait
-- on each other (no deadlock). Keys whose hashes collide only share a lock.
-- Locks cover keys that have no row yet, so a first charge races no one.

-- Time, from the server's clock (as the Lua scripts read Redis' TIME).
CREATE OR REPLACE FUNCTION mcpbg_now() RETURNS double precision
LANGUAGE sql VOLATILE AS $$ SELECT extract(epoch FROM clock_timestamp())::double precision $$;

-- The exact range (counters.MAX_COUNTER, counters.stays_exact).
CREATE OR REPLACE FUNCTION mcpbg_stays_exact(c bigint, f bigint, amount bigint, inline boolean)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT abs(cc) <= 9007199254740991 AND abs(ff) <= 9007199254740991
       AND abs(cc + ff) <= 9007199254740991
    FROM (SELECT c::numeric + CASE WHEN inline THEN amount ELSE 0 END AS cc,
                 f::numeric + CASE WHEN inline THEN 0 ELSE amount END AS ff) AS parts
$$;

-- Take the advisory locks of p_keys, in the one fixed order.
CREATE OR REPLACE FUNCTION mcpbg_lock(p_keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h integer;
BEGIN
    FOR h IN SELECT DISTINCT hashtext(k) FROM unnest(p_keys) AS k ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(1835233378, h);
    END LOOP;
END $$;

-- Drop counter p_key if it has ended (with its in-flight entries). Called under its lock.
CREATE OR REPLACE FUNCTION mcpbg_drop_ended(p_key text, p_now double precision) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM mcpbg_counter WHERE key = p_key AND expire_at <= p_now;
    IF FOUND THEN
        DELETE FROM mcpbg_pending WHERE key = p_key;
    END IF;
END $$;

-- Add a charge (lib.lua add): committed when p_event_id is '', in-flight under it
-- otherwise; the expiry is repaired. The counter is live (mcpbg_drop_ended ran).
CREATE OR REPLACE FUNCTION mcpbg_add(p_key text, p_amount bigint, p_event_id text,
                                     p_expire_at double precision) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_event_id = '' THEN
        INSERT INTO mcpbg_counter AS t (key, committed, expire_at)
        VALUES (p_key, p_amount, p_expire_at)
        ON CONFLICT (key) DO UPDATE
        SET committed = t.committed + excluded.committed, expire_at = excluded.expire_at;
    ELSE
        INSERT INTO mcpbg_counter AS t (key, in_flight, expire_at)
        VALUES (p_key, p_amount, p_expire_at)
        ON CONFLICT (key) DO UPDATE
        SET in_flight = t.in_flight + excluded.in_flight, expire_at = excluded.expire_at;
        INSERT INTO mcpbg_pending AS p (key, event_id, amount)
        VALUES (p_key, p_event_id, p_amount)
        ON CONFLICT (key, event_id) DO UPDATE SET amount = p.amount + excluded.amount;
    END IF;
END $$;

-- The effective cap of one counter: caps.effective / lib.lua effective_cap, step for step.
-- p_field '' means no run-time lookup. p_plan_caps: "<plan> <cap> ..." (the plans
-- capping this limit); p_plan_fields: the assignment fields, comma-separated.
CREATE OR REPLACE FUNCTION mcpbg_effective_cap(
    p_caps_key text, p_field text, p_default bigint, p_value_cap bigint,
    p_plan_fields text, p_plan_caps text, p_file_plan text, p_now double precision)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    rt record;
    plan text;
    f text;
    parts text[];
    i integer;
BEGIN
    IF p_field = '' THEN
        RETURN p_default;
    END IF;
    SELECT cap, until INTO rt FROM mcpbg_cap WHERE caps_key = p_caps_key AND field = p_field;
    IF FOUND AND (rt.until = 0 OR p_now < rt.until) THEN
        RETURN rt.cap;
    END IF;
    IF p_value_cap IS NOT NULL THEN
        RETURN p_value_cap;
    END IF;
    IF p_plan_caps = '' THEN
        RETURN p_default;
    END IF;
    plan := NULL;
    FOREACH f IN ARRAY string_to_array(p_plan_fields, ',') LOOP
        SELECT a.plan INTO plan FROM mcpbg_plan AS a WHERE a.field = f;
        EXIT WHEN plan IS NOT NULL;
    END LOOP;
    IF plan IS NULL THEN
        plan := p_file_plan;
    END IF;
    IF plan <> '' THEN
        parts := string_to_array(p_plan_caps, ' ');
        FOR i IN 1 .. coalesce(array_length(parts, 1), 0) / 2 LOOP
            IF parts[2 * i - 1] = plan THEN
                RETURN parts[2 * i]::bigint;
            END IF;
        END LOOP;
    END IF;
    RETURN p_default;
END $$;

-- Whether the epoch marker is whole (lib.lua epoch_ok, keys.EPOCH_VALUE).
CREATE OR REPLACE FUNCTION mcpbg_epoch_ok() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM mcpbg_meta WHERE name = 'epoch'
                   AND value ~ '^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$')
$$;

-- Atomic, all-or-nothing charge over every counter a call touches (lua/charge.lua).
--
-- p_event_id  '' commits inline; else amounts go in-flight under it
-- p_op_id     '' or the operation id of an inline charge (a replay changes nothing)
-- p_keys, p_amounts, p_caps, p_enforce, p_expire: per counter
-- p_resolve   whether each cap is resolved here (caps.py) from p_caps_keys,
--             p_fields ('' for none), p_value_caps (NULL: none), p_plan_fields,
--             p_plan_caps, p_file_plans; the grant is added; p_has_ref false for
--             an op the policy gives no CapRef (its default cap, no grant)
-- p_lease_id  '' or the lease id for the lease sets among p_keys, held p_lease_ms
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
    p_lease_id text, p_lease_ms bigint)
RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    now_ms bigint := floor(now_s * 1000)::bigint;
    n integer := coalesce(array_length(p_keys, 1), 0);
    inline boolean := p_event_id = '';
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
BEGIN
    IF p_require_epoch AND NOT mcpbg_epoch_ok() THEN
        RETURN ARRAY[-1]::bigint[];
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
        IF refused = 0 AND p_enforce[i] AND used[i] + greatest(p_amounts[i], 1) > cap THEN
            refused := i;
        END IF;
    END LOOP;
    IF refused > 0 THEN
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
        ELSIF p_amounts[i] <> 0 THEN
            PERFORM mcpbg_add(p_keys[i], p_amounts[i],
                              CASE WHEN inline THEN '' ELSE p_event_id END, p_expire[i]);
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

-- The shapes of keys (apply.lua, change.lua): a counter, or a key a change writes.
CREATE OR REPLACE FUNCTION mcpbg_counter_key_ok(p_key text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_key ~ '^mcpbg:v1:[A-Za-z0-9][A-Za-z0-9_.\-]*:[^:]+:[^:]+$'
$$;

CREATE OR REPLACE FUNCTION mcpbg_change_key_ok(p_key text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_key ~ '^mcpbg:v1:_caps:[A-Za-z0-9][A-Za-z0-9_.\-]*$' OR p_key = 'mcpbg:v1:_plans'
$$;

-- Apply one run-time change (lib.lua apply_change): value caps, plan assignments,
-- and, while the bucket lives, grants (added) and resets (set). Called under the
-- key's lock.
CREATE OR REPLACE FUNCTION mcpbg_apply_change(
    p_kind text, p_key text, p_field text, p_amount bigint, p_until bigint, p_plan text,
    p_why text, p_now double precision) RETURNS void
LANGUAGE plpgsql AS $$
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

-- Projection of ledger events into committed counters, exactly once (lua/apply.lua).
-- Per event (arrays by event): offset, id, seen day and its expiry, number of
-- charges and of changes; the charges and changes follow in their own arrays, in
-- event order. Offsets at or below the partition's watermark, and ids already in
-- their day's seen set, are skipped; for a fresh event each charge's in-flight
-- entry is removed and the ledger's amount committed (dropped when its bucket has
-- ended). The watermark moves in the same transaction, to p_through at least.
-- Returns the number of events applied, or -1 when the epoch is required and missing.
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
                    PERFORM mcpbg_add(k, p_camounts[ci], '', p_cexpire[ci]);
                END IF;
            END IF;
        END LOOP;
        FOR j IN 1 .. p_nchanges[e] LOOP
            xi := xi + 1;
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

-- Run-time changes written directly, no ledger (lua/change.lua); every key checked first.
CREATE OR REPLACE FUNCTION mcpbg_change(
    p_kinds text[], p_keys text[], p_fields text[], p_amounts bigint[], p_untils bigint[],
    p_plans text[], p_whys text[])
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    n integer := coalesce(array_length(p_kinds, 1), 0);
    i integer;
BEGIN
    FOR i IN 1 .. n LOOP
        IF NOT (mcpbg_counter_key_ok(p_keys[i]) OR mcpbg_change_key_ok(p_keys[i])) THEN
            RAISE EXCEPTION 'mcpbg change: refused: % is no key a change writes', p_keys[i];
        END IF;
    END LOOP;
    PERFORM mcpbg_lock(p_keys);
    FOR i IN 1 .. n LOOP
        PERFORM mcpbg_apply_change(p_kinds[i], p_keys[i], p_fields[i], p_amounts[i],
                                   p_untils[i], p_plans[i], p_whys[i], now_s);
    END LOOP;
    RETURN n;
END $$;

-- Leases (lua/lease.lua): 'r' release p_lease_id from every set, 'n' renew it to now +
-- p_ttl_ms where still alive (an expired lease is not revived), 'c' count live leases.
CREATE OR REPLACE FUNCTION mcpbg_leases(p_mode text, p_keys text[], p_lease_id text,
                                        p_ttl_ms bigint)
RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
    now_ms bigint := floor(mcpbg_now() * 1000)::bigint;
    out bigint[] := '{}';
    i integer;
    cnt bigint;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        IF left(p_keys[i], 16) <> 'mcpbg:v1:_lease:' THEN
            RAISE EXCEPTION 'mcpbg lease: not a lease set: %', p_keys[i];
        END IF;
    END LOOP;
    PERFORM mcpbg_lock(p_keys);
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        DELETE FROM mcpbg_lease WHERE key = p_keys[i] AND until_ms <= now_ms;
        IF p_mode = 'r' THEN
            DELETE FROM mcpbg_lease WHERE key = p_keys[i] AND lease_id = p_lease_id;
            GET DIAGNOSTICS cnt = ROW_COUNT;
        ELSIF p_mode = 'n' THEN
            UPDATE mcpbg_lease SET until_ms = now_ms + p_ttl_ms
            WHERE key = p_keys[i] AND lease_id = p_lease_id;
            GET DIAGNOSTICS cnt = ROW_COUNT;
        ELSE
            SELECT count(*) INTO cnt FROM mcpbg_lease WHERE key = p_keys[i];
        END IF;
        out[i] := cnt;
    END LOOP;
    RETURN out;
END $$;

-- committed + in-flight of each key (0 for an absent or ended counter).
CREATE OR REPLACE FUNCTION mcpbg_usage(p_keys text[]) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(coalesce(t.committed + t.in_flight, 0) ORDER BY k.ord), '{}')
    FROM unnest(p_keys) WITH ORDINALITY AS k(key, ord)
    LEFT JOIN mcpbg_counter AS t ON t.key = k.key AND t.expire_at > mcpbg_now()
$$;

-- Rewrite counters from the ledger (lua/rewrite.lua: mcpbg replay, reconcile --fix),
-- refused (-1, nothing written) when the watermarks are not p_expected (NULL: no
-- check). 'set': committed := amount; 'add': committed += amount. Per counter the
-- in-flight entries of p_drop_ids (a jsonb array of id arrays) are dropped, and
-- expire_at repaired unless 0. Then p_marks (jsonb partition -> offset) are set.
CREATE OR REPLACE FUNCTION mcpbg_rewrite(
    p_mode text, p_expected jsonb, p_keys text[], p_amounts bigint[],
    p_expire double precision[], p_drop_ids jsonb, p_marks jsonb)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    i integer;
    k text;
    id text;
    pend bigint;
    have jsonb;
BEGIN
    -- Every partition's watermark lock too: no projection moves while the check holds.
    PERFORM mcpbg_lock(p_keys || ARRAY(SELECT 'mcpbg:v1:_applied:' || partition
                                       FROM mcpbg_watermark));
    IF p_expected IS NOT NULL THEN
        SELECT coalesce(jsonb_object_agg(partition, applied), '{}') INTO have FROM mcpbg_watermark;
        IF have <> p_expected THEN
            RETURN -1;
        END IF;
    END IF;
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        k := p_keys[i];
        PERFORM mcpbg_drop_ended(k, now_s);
        INSERT INTO mcpbg_counter AS t (key, committed, expire_at)
        VALUES (k, p_amounts[i], CASE WHEN p_expire[i] = 0 THEN 'infinity' ELSE p_expire[i] END)
        ON CONFLICT (key) DO UPDATE
        SET committed = CASE WHEN p_mode = 'add' THEN t.committed + p_amounts[i]
                             ELSE p_amounts[i] END,
            expire_at = CASE WHEN p_expire[i] = 0 THEN t.expire_at ELSE p_expire[i] END;
        FOR id IN SELECT jsonb_array_elements_text(coalesce(p_drop_ids -> (i - 1), '[]')) LOOP
            DELETE FROM mcpbg_pending WHERE key = k AND event_id = id RETURNING amount INTO pend;
            IF FOUND THEN
                UPDATE mcpbg_counter SET in_flight = in_flight - pend WHERE key = k;
            END IF;
        END LOOP;
    END LOOP;
    INSERT INTO mcpbg_watermark AS w (partition, applied)
    SELECT key, value::bigint FROM jsonb_each_text(coalesce(p_marks, '{}'))
    ON CONFLICT (partition) DO UPDATE SET applied = excluded.applied;
    RETURN coalesce(array_length(p_keys, 1), 0);
END $$;

-- Garbage collection: delete up to p_limit ended rows of each table. Correctness never
-- depends on it (every read ignores ended rows); it keeps the tables at the live buckets.
CREATE OR REPLACE FUNCTION mcpbg_gc(p_limit integer DEFAULT 10000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    now_ms bigint := floor(now_s * 1000)::bigint;
    total integer := 0;
    cnt integer;
    k text;
    ks text[];
BEGIN
    SELECT array_agg(key) INTO ks
    FROM (SELECT key FROM mcpbg_counter WHERE expire_at <= now_s LIMIT p_limit) AS ended;
    IF ks IS NOT NULL THEN
        PERFORM mcpbg_lock(ks);  -- all at once: the one fixed order
        FOREACH k IN ARRAY ks LOOP
            PERFORM mcpbg_drop_ended(k, now_s);
            total := total + 1;
        END LOOP;
    END IF;
    DELETE FROM mcpbg_op WHERE op_id IN
        (SELECT op_id FROM mcpbg_op WHERE expire_ms <= now_ms LIMIT p_limit);
    GET DIAGNOSTICS cnt = ROW_COUNT;
    total := total + cnt;
    DELETE FROM mcpbg_seen WHERE (day, event_id) IN
        (SELECT day, event_id FROM mcpbg_seen WHERE expire_at <= now_s LIMIT p_limit);
    GET DIAGNOSTICS cnt = ROW_COUNT;
    total := total + cnt;
    DELETE FROM mcpbg_lease WHERE (key, lease_id) IN
        (SELECT key, lease_id FROM mcpbg_lease WHERE until_ms <= now_ms LIMIT p_limit);
    GET DIAGNOSTICS cnt = ROW_COUNT;
    RETURN total + cnt;
END $$;
