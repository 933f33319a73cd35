-- The counter model of counters.py in tables (lua/lib.lua keeps the same in hashes).
-- Every row that can end carries its end (expire_at, epoch seconds; until_ms for
-- leases): a row past its end reads as absent, and is deleted when a function
-- touches it or by mcpbg_gc(). Deleting is garbage collection, never correctness.

-- One row per counter key (mcpbg:v1:<limit>:<scope>:<bucket>): committed, the
-- in-flight total, the grant (room this bucket, not spend) and its why token.
CREATE TABLE mcpbg_counter (
    key text PRIMARY KEY,
    committed bigint NOT NULL DEFAULT 0,
    in_flight bigint NOT NULL DEFAULT 0,
    grant_amount bigint NOT NULL DEFAULT 0,
    why text,
    expire_at double precision NOT NULL
);
CREATE INDEX mcpbg_counter_expire ON mcpbg_counter (expire_at);

-- The in-flight amount of one event on one counter, moved once by mcpbg_apply.
CREATE TABLE mcpbg_pending (
    key text NOT NULL,
    event_id text NOT NULL,
    amount bigint NOT NULL,
    PRIMARY KEY (key, event_id)
);

-- Operation markers of inline charges (keys.OP_HORIZON_SECONDS): a replay changes nothing.
CREATE TABLE mcpbg_op (
    op_id text PRIMARY KEY,
    expire_ms bigint NOT NULL
);
CREATE INDEX mcpbg_op_expire ON mcpbg_op (expire_ms);

-- The projection's applied offset per partition ("<topic>:<partition>").
CREATE TABLE mcpbg_watermark (
    partition text PRIMARY KEY,
    applied bigint NOT NULL
);

-- Event ids applied, per UTC day (AppliedEvent.seen_day), until the day's end plus grace.
CREATE TABLE mcpbg_seen (
    day text NOT NULL,
    event_id text NOT NULL,
    expire_at double precision NOT NULL,
    PRIMARY KEY (day, event_id)
);
CREATE INDEX mcpbg_seen_expire ON mcpbg_seen (expire_at);

-- Markers: 'epoch' (keys.EPOCH_VALUE) declares the counters complete.
CREATE TABLE mcpbg_meta (
    name text PRIMARY KEY,
    value text NOT NULL
);

-- Run-time value caps (caps.CAPS_PREFIX hashes): per caps key and scope field.
CREATE TABLE mcpbg_cap (
    caps_key text NOT NULL,
    field text NOT NULL,
    cap bigint NOT NULL,
    until bigint NOT NULL,
    why text NOT NULL DEFAULT '-',
    PRIMARY KEY (caps_key, field)
);

-- Run-time plan assignments (caps.PLANS_KEY): tenant=<v> / user=<v> -> plan.
CREATE TABLE mcpbg_plan (
    field text PRIMARY KEY,
    plan text NOT NULL
);

-- Concurrency leases (keys.lease_key): one row per lease, until its expiry (ms).
CREATE TABLE mcpbg_lease (
    key text NOT NULL,
    lease_id text NOT NULL,
    until_ms bigint NOT NULL,
    PRIMARY KEY (key, lease_id)
);
