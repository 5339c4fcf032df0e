-- Outbox relay: per-key ordering buckets, the topic registry the relay validates
-- against, dead letters, and per-topic counters that metrics read from PostgreSQL.
-- depends: 0001_chessboard_schema

-- Every event of one key lands in one of 16 buckets. md5 (not hashtext) because the bucket must
-- never change across PostgreSQL versions: two buckets for one key would let two relays
-- interleave that key. Keep the 16 in step with the rows of chessboard.outbox_buckets below.
ALTER TABLE chessboard.outbox_events
    ADD COLUMN key_bucket smallint NOT NULL
        GENERATED ALWAYS AS ((get_byte(decode(md5(message_key), 'hex'), 0) % 16)::smallint) STORED;
CREATE INDEX ix_outbox_events_bucket ON chessboard.outbox_events (key_bucket, id);

-- One row per bucket. A relay publishes a bucket's events only while it holds that row locked
-- (FOR UPDATE [SKIP LOCKED], see sql/postgres/queries/outbox.sql): one publisher per key at a time.
CREATE TABLE chessboard.outbox_buckets (
    bucket smallint PRIMARY KEY
);
INSERT INTO chessboard.outbox_buckets (bucket) SELECT generate_series(0, 15);

-- The topics the relay may publish and the payload fields each requires (contract section 4).
-- An outbox row for another topic or without these fields is dead-lettered, never published.
CREATE TABLE chessboard.outbox_topics (
    topic text PRIMARY KEY,
    required_fields text[] NOT NULL
);
INSERT INTO chessboard.outbox_topics (topic, required_fields) VALUES
    ('pin.chessboard.project-upserted.v1',
     '{ContractVersion,EventId,CreatedAt,Id,Version,TenantId,Name,Status,PriceMin,PriceMax,PropertyObjectsTotalCount,PropertyObjectsFreeCount}'),
    ('pin.chessboard.layout-upserted.v1',
     '{ContractVersion,EventId,CreatedAt,Id,Version,ProjectId,LayoutGroupId,TotalArea,PropertyObjectsCount}'),
    ('pin.chessboard.layout-group-upserted.v1',
     '{ContractVersion,EventId,CreatedAt,Id,Version,ProjectId,TenantId,Name,SortOrder,IsArchived,LayoutsCount,AreaMin,AreaMax}');

-- Rows the relay could not publish (malformed, unknown topic, too large for the broker), moved
-- here in the same transaction that removes them from the outbox. id is the outbox id.
CREATE TABLE chessboard.outbox_dead_letters (
    id bigint PRIMARY KEY,
    topic text NOT NULL,
    message_key text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    error text NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);

-- Monotonic counters, updated in the transaction that deletes the published rows, so they count
-- each acknowledged event once even when dead letters are purged or the relay restarts.
CREATE TABLE chessboard.outbox_topic_stats (
    topic text PRIMARY KEY,
    published bigint NOT NULL DEFAULT 0,
    dead_lettered bigint NOT NULL DEFAULT 0,
    last_published_at timestamptz,
    last_dead_lettered_at timestamptz
);
