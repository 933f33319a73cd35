-- The wait queue of concurrency caps (Governor.check(wait=)), as lua/lib.lua keeps it
-- in a sorted set per lease set: first come, first served on every replica.

-- One row per waiting ticket "<id>/<wait ms>" in a lease set's queue: its arrival
-- (server clock, ms) and the end of its wait, after which it holds no place.
CREATE TABLE mcpbg_wait (
    key text NOT NULL,
    ticket text NOT NULL,
    arrived_ms bigint NOT NULL,
    until_ms bigint NOT NULL,
    PRIMARY KEY (key, ticket)
);
CREATE INDEX mcpbg_wait_order ON mcpbg_wait (key, arrived_ms, ticket);
CREATE INDEX mcpbg_wait_expire ON mcpbg_wait (until_ms);

-- A ticket's wait in ms (the number after its last '/'; 0 when it has none).
CREATE OR REPLACE FUNCTION mcpbg_ticket_ms(p_ticket text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(substring(p_ticket FROM '/([0-9]{1,15})$')::bigint, 0)
$$;

-- How many live waiters of lease set p_key come before p_ticket ('': everyone),
-- counting at most p_room (lib.lua waiters_ahead); ended tickets are dropped.
-- Called under the lease set's lock. Order: arrival, then the ticket (ZRANGE's).
CREATE OR REPLACE FUNCTION mcpbg_waiters_ahead(p_key text, p_ticket text, p_room bigint,
                                               p_now_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    mine bigint;
    ahead bigint;
BEGIN
    DELETE FROM mcpbg_wait WHERE key = p_key AND until_ms <= p_now_ms;
    SELECT arrived_ms INTO mine FROM mcpbg_wait WHERE key = p_key AND ticket = p_ticket;
    IF p_ticket = '' OR NOT FOUND THEN
        SELECT count(*) INTO ahead FROM (SELECT 1 FROM mcpbg_wait WHERE key = p_key
                                         LIMIT p_room) AS w;
    ELSE
        SELECT count(*) INTO ahead FROM (SELECT 1 FROM mcpbg_wait WHERE key = p_key
                                         AND (arrived_ms, ticket) < (mine, p_ticket)
                                         LIMIT p_room) AS w;
    END IF;
    RETURN ahead;
END $$;

-- The charge takes the waiting call's ticket now: the old signature goes.
DROP FUNCTION mcpbg_charge(text, text, boolean, boolean, text[], bigint[], bigint[],
    boolean[], double precision[], boolean, boolean[], text[], text[], bigint[], text[],
    text[], text[], text, bigint);

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


-- A waiting call gave up (lua/lease.lua 'q'): take p_ticket out of the queues of the
-- lease sets p_keys; how many held it.
CREATE OR REPLACE FUNCTION mcpbg_leave(p_keys text[], p_ticket text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    cnt bigint;
BEGIN
    PERFORM mcpbg_lock(p_keys);
    DELETE FROM mcpbg_wait WHERE key = ANY(p_keys) AND ticket = p_ticket;
    GET DIAGNOSTICS cnt = ROW_COUNT;
    RETURN cnt;
END $$;

-- Garbage collection (as in 0002, and the ended waiting tickets): up to p_limit ended
-- rows of each table. Correctness never depends on it (every read ignores ended rows);
-- it keeps the tables at the live buckets.
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
    total := total + cnt;
    DELETE FROM mcpbg_wait WHERE (key, ticket) IN
        (SELECT key, ticket FROM mcpbg_wait WHERE until_ms <= now_ms LIMIT p_limit);
    GET DIAGNOSTICS cnt = ROW_COUNT;
    RETURN total + cnt;
END $$;
