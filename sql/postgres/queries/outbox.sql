-- Named queries of the outbox relay (issue 4). Parameters are :named (aiosql).
--
-- Ordering rule: events of one key are published by one relay at a time, in id order. For one key
-- id order is commit order (the drain UPDATEs the entity row before it INSERTs the event, so a
-- second event of that key waits for the first one's commit). Across keys ids may commit out of
-- order, so nothing here remembers a "last published id": every run scans from the lowest id.
--
-- Claim = the bucket's row lock, held by the batch's transaction. Lock order inside one relay
-- transaction, the same in every relay so they cannot deadlock: bucket rows (claim_free_buckets /
-- claim_bucket) → topic counters in topic order (count_relayed). Waits are bounded by the
-- session's lock_timeout.

-- name: configure_session(lock_timeout, idle_timeout)^
-- A relay never waits forever on another relay's bucket, and a relay stuck between statements
-- (SIGSTOP, a hung broker call) loses its session, so its buckets go to the next relay.
SELECT set_config('lock_timeout', :lock_timeout, false),
       set_config('idle_in_transaction_session_timeout', :idle_timeout, false),
       set_config('application_name', 'pin-outbox-relay', false);

-- name: outbox_horizon()$
-- The highest id visible at the start of a run: every event committed before the start has an id
-- up to it. It only bounds the run (so it ends under a steady insert load); it is not a watermark.
SELECT max(id) FROM chessboard.outbox_events;

-- name: all_buckets()
SELECT bucket FROM chessboard.outbox_buckets ORDER BY bucket;

-- name: claim_free_buckets(buckets)
-- SKIP LOCKED at bucket level: buckets another relay is publishing are left to it for now; the
-- caller comes back for them (claim_bucket) if they still hold events it must publish.
SELECT bucket FROM chessboard.outbox_buckets
WHERE bucket = ANY(:buckets::smallint[])
ORDER BY bucket
FOR UPDATE SKIP LOCKED;

-- name: buckets_with_events(buckets, horizon)
-- Plain read, no lock: which of the busy buckets still hold events up to the horizon.
SELECT b.bucket FROM chessboard.outbox_buckets b
WHERE b.bucket = ANY(:buckets::smallint[])
  AND EXISTS (SELECT 1 FROM chessboard.outbox_events e
              WHERE e.key_bucket = b.bucket AND e.id <= :horizon)
ORDER BY b.bucket;

-- name: claim_bucket(bucket)$
-- Waits (up to lock_timeout) for the relay holding the bucket to commit.
SELECT bucket FROM chessboard.outbox_buckets WHERE bucket = :bucket FOR UPDATE;

-- name: claim_events(buckets, horizon, limit)
-- The oldest events of the claimed buckets, with the reason each one cannot be published (NULL
-- when it can). No row locks: holding the bucket already makes this transaction the only
-- publisher of these keys, and locking each event before deleting it writes every row twice
-- (measured: a third of the relay's throughput). Never SKIP LOCKED inside a bucket: skipping a
-- row would publish its key's next version before it.
-- The value and the topic-free checks were computed when the row was written (migration 0005);
-- only the registry's checks run here. The value leaves as UTF-8 bytea, so the binary cursor
-- hands Python the bytes Kafka sends.
SELECT e.id, e.topic, e.message_key, convert_to(e.wire_value, 'UTF8') AS value,
       CASE
           WHEN t.topic IS NULL THEN 'unknown topic ' || e.topic
           WHEN e.defect IS NOT NULL THEN e.defect
           WHEN NOT e.payload ?& t.required_fields
               THEN 'payload misses ' || array_to_string(ARRAY(
                   SELECT f FROM unnest(t.required_fields) f WHERE NOT e.payload ? f), ', ')
       END AS error
FROM chessboard.outbox_events e
LEFT JOIN chessboard.outbox_topics t ON t.topic = e.topic
WHERE e.key_bucket = ANY(:buckets::smallint[]) AND e.id <= :horizon
ORDER BY e.id
LIMIT :limit;

-- name: dead_letter_events(ids, errors)!
-- Moves rows aside with their error, in the transaction that holds their bucket.
WITH bad AS (
    SELECT * FROM unnest(:ids::bigint[], :errors::text[]) AS b (id, error)
), moved AS (
    DELETE FROM chessboard.outbox_events e USING bad
    WHERE e.id = bad.id
    RETURNING e.id, e.topic, e.message_key, e.payload, e.created_at, bad.error
)
INSERT INTO chessboard.outbox_dead_letters (id, topic, message_key, payload, created_at, error)
SELECT id, topic, message_key, payload, created_at, error FROM moved
ON CONFLICT (id) DO UPDATE SET error = excluded.error, dead_lettered_at = now();

-- name: delete_published(firsts, lasts)!
-- Only rows the broker acknowledged, in the transaction that holds their bucket. Each
-- [first, last] is a run of consecutive ids that were all read and acknowledged in this batch
-- (ids are unique, so no row committed later falls inside one; see _id_runs in outbox.py).
-- The arrays are literals (see outbox.py).
DELETE FROM chessboard.outbox_events e
USING unnest(:firsts::bigint[], :lasts::bigint[]) AS r (first_id, last_id)
WHERE e.id BETWEEN r.first_id AND r.last_id;

-- name: count_relayed(topics, published, dead_lettered)!
-- Same transaction as the deletes: a counter never runs ahead of or behind the outbox. Rows are
-- upserted in topic order, so two relays lock the counters in the same order.
INSERT INTO chessboard.outbox_topic_stats AS s
    (topic, published, dead_lettered, last_published_at, last_dead_lettered_at)
SELECT c.topic, c.published, c.dead_lettered,
       CASE WHEN c.published > 0 THEN now() END,
       CASE WHEN c.dead_lettered > 0 THEN now() END
FROM unnest(:topics::text[], :published::bigint[], :dead_lettered::bigint[])
     AS c (topic, published, dead_lettered)
ORDER BY c.topic
ON CONFLICT (topic) DO UPDATE SET
    published = s.published + excluded.published,
    dead_lettered = s.dead_lettered + excluded.dead_lettered,
    last_published_at = coalesce(excluded.last_published_at, s.last_published_at),
    last_dead_lettered_at = coalesce(excluded.last_dead_lettered_at, s.last_dead_lettered_at);

-- name: topic_stats()
-- Counters per topic, for metrics (an exporter reads these; they survive relay restarts).
SELECT topic, published, dead_lettered,
       extract(epoch FROM last_published_at)::float8 AS last_published_at
FROM chessboard.outbox_topic_stats
ORDER BY topic;

-- name: backlog()^
-- Events waiting and the age of the oldest one: the relay lag.
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM clock_timestamp() - min(created_at)), 0)::float8 AS lag_seconds
FROM chessboard.outbox_events;

-- name: relay_topics()
-- The topics the relay creates on the broker before its first batch.
SELECT topic FROM chessboard.outbox_topics ORDER BY topic;
