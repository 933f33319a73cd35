-- Whole-store rewrites (mcpbg replay, reconcile --fix) in one transaction.
--
-- The store lock: every function takes it shared in mcpbg_lock, before its key
-- locks; mcpbg_rewrite_staged takes it exclusive. A rewrite of many counters thus
-- waits for the calls in progress, runs alone, and commits all at once: no one ever
-- sees half-rebuilt counters, and no lock table fills up with one lock per counter.
-- Always first, so the one fixed order (store lock, then key locks) still holds.
CREATE OR REPLACE FUNCTION mcpbg_lock(p_keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h integer;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1835233380, 0);
    FOR h IN SELECT DISTINCT hashtext(k) FROM unnest(p_keys) AS k ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(1835233378, h);
    END LOOP;
END $$;

-- The staging tables a client fills (COPY) before calling mcpbg_rewrite_staged, in
-- the same transaction: counters (amount: the new committed, or with 'add' the
-- correction; expire_at 0: keep the counter's), in-flight entries to drop (events
-- the ledger has counted), and seen ids (AppliedEvent.seen_day and its expiry).
CREATE OR REPLACE FUNCTION mcpbg_stage() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    CREATE TEMP TABLE IF NOT EXISTS mcpbg_stage_counter (
        key text PRIMARY KEY, amount bigint NOT NULL, expire_at double precision NOT NULL
    ) ON COMMIT DROP;
    CREATE TEMP TABLE IF NOT EXISTS mcpbg_stage_drop (
        key text NOT NULL, event_id text NOT NULL, PRIMARY KEY (key, event_id)
    ) ON COMMIT DROP;
    CREATE TEMP TABLE IF NOT EXISTS mcpbg_stage_seen (
        day text NOT NULL, event_id text NOT NULL, expire_at double precision NOT NULL
    ) ON COMMIT DROP;
END $$;

-- Write what is staged (mcpbg_rewrite's rules, set-based), under the store lock held
-- exclusive until the caller commits. Refused (-1, nothing written) when the
-- watermarks are not p_expected (NULL: no check): a projector applied meanwhile.
-- 'set': committed := amount; 'add': committed += amount. Then the seen ids, the
-- watermarks p_marks (jsonb partition -> offset) and, unless '', the epoch marker.
-- Returns the number of counters written.
CREATE OR REPLACE FUNCTION mcpbg_rewrite_staged(
    p_mode text, p_expected jsonb, p_marks jsonb, p_epoch text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    now_s double precision := mcpbg_now();
    have jsonb;
    n integer;
BEGIN
    PERFORM pg_advisory_xact_lock(1835233380, 0);
    IF p_expected IS NOT NULL THEN
        SELECT coalesce(jsonb_object_agg(partition, applied), '{}') INTO have FROM mcpbg_watermark;
        IF have <> p_expected THEN
            RETURN -1;
        END IF;
    END IF;
    -- Ended counters are absent (mcpbg_drop_ended): gone with their in-flight entries.
    DELETE FROM mcpbg_pending AS p USING mcpbg_counter AS c, mcpbg_stage_counter AS s
    WHERE p.key = c.key AND c.key = s.key AND c.expire_at <= now_s;
    DELETE FROM mcpbg_counter AS c USING mcpbg_stage_counter AS s
    WHERE c.key = s.key AND c.expire_at <= now_s;
    INSERT INTO mcpbg_counter AS t (key, committed, expire_at)
    SELECT s.key, s.amount, CASE WHEN s.expire_at = 0 THEN 'infinity' ELSE s.expire_at END
    FROM mcpbg_stage_counter AS s
    ON CONFLICT (key) DO UPDATE
    SET committed = CASE WHEN p_mode = 'add' THEN t.committed + excluded.committed
                         ELSE excluded.committed END,
        expire_at = CASE WHEN excluded.expire_at = 'infinity' THEN t.expire_at
                         ELSE excluded.expire_at END;
    GET DIAGNOSTICS n = ROW_COUNT;
    WITH gone AS (
        DELETE FROM mcpbg_pending AS p USING mcpbg_stage_drop AS d
        WHERE p.key = d.key AND p.event_id = d.event_id
        RETURNING p.key, p.amount
    )
    UPDATE mcpbg_counter AS c SET in_flight = c.in_flight - g.amount
    FROM (SELECT key, sum(amount)::bigint AS amount FROM gone GROUP BY key) AS g
    WHERE c.key = g.key;
    INSERT INTO mcpbg_seen AS s (day, event_id, expire_at)
    SELECT DISTINCT ON (day, event_id) day, event_id, expire_at FROM mcpbg_stage_seen
    ON CONFLICT (day, event_id) DO UPDATE SET expire_at = excluded.expire_at;
    INSERT INTO mcpbg_watermark AS w (partition, applied)
    SELECT key, value::bigint FROM jsonb_each_text(coalesce(p_marks, '{}'))
    ON CONFLICT (partition) DO UPDATE SET applied = excluded.applied;
    IF p_epoch <> '' THEN
        INSERT INTO mcpbg_meta (name, value) VALUES ('epoch', p_epoch)
        ON CONFLICT (name) DO UPDATE SET value = excluded.value;
    END IF;
    RETURN n;
END $$;
