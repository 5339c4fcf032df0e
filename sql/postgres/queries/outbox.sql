-- Named queries of the outbox relay. Parameters are :named (aiosql).
--
-- Ordering rule: one relay publishes at a time (lock_relay), in id order, one Kafka transaction per
-- batch. For one key id order is commit order (the drain UPDATEs the entity row before it INSERTs
-- the event, so a second event of that key waits for the first one's commit). Across keys ids may
-- commit out of order, so nothing here remembers a "last published id": every batch scans from
-- the lowest id.
--
-- A batch's rows are deleted in the PostgreSQL transaction that is committed right after its
-- Kafka transaction; outbox_relay_commits records which Kafka transaction that was, and the
-- receipt in Kafka (see outbox.py) says which one committed there.

-- name: configure_session(lock_timeout, idle_timeout)^
-- A relay never waits forever for another relay's lock, and a relay stuck between statements
-- (SIGSTOP, a hung broker call), in a batch or between runs, loses its session, and with it the
-- lock, to the next relay (whose producer then fences the stuck one's).
SELECT set_config('lock_timeout', :lock_timeout, false),
       set_config('idle_in_transaction_session_timeout', :idle_timeout, false),
       set_config('idle_session_timeout', :idle_timeout, false),
       set_config('application_name', 'pin-outbox-relay', false);

-- name: listen_outbox()!
-- The relay's listening session (relay/listener.py): a notification at the commit of every
-- transaction that wrote the outbox (the trigger outbox_events_notify, schema/outbox.sql).
LISTEN chessboard_outbox_events;

-- name: outbox_horizon()$
-- The highest id visible at the start of a run: every event committed before the start has an id
-- up to it. It only bounds the run (so it ends under a steady insert load); it is not a watermark.
SELECT max(id) FROM chessboard.outbox_events;

-- name: lock_relay()!
-- The one publisher of this outbox: held by the relay's session for as long as it holds its
-- transactional producer, so a second relay waits here (up to lock_timeout) instead of fencing
-- the first one's producer mid-batch. Keyed by the outbox table: one lock per database.
SELECT pg_advisory_lock('chessboard.outbox_events'::regclass::oid::int, 0);

-- name: unlock_relay()!
SELECT pg_advisory_unlock('chessboard.outbox_events'::regclass::oid::int, 0);

-- name: relay_commit_state(transactional_id)^
-- This outbox's receipt identity and the seq of its last transaction whose rows were deleted
-- (0 before the first). DO NOTHING takes no row lock, so reading it never waits.
WITH created AS (
    INSERT INTO chessboard.outbox_relay_commits (transactional_id) VALUES (:transactional_id)
    ON CONFLICT (transactional_id) DO NOTHING
    RETURNING outbox_id, last_seq
)
SELECT outbox_id::text, last_seq FROM created
UNION ALL
SELECT outbox_id::text, last_seq FROM chessboard.outbox_relay_commits
WHERE transactional_id = :transactional_id;

-- name: record_commit(transactional_id, seq)$
-- In the transaction that deletes the rows of Kafka transaction `seq`. Never moves back: NULL
-- when `seq` is not above the stored one (the caller's idea of the last seq is wrong). Recovery
-- may skip ahead (a database restored from a backup is behind Kafka).
UPDATE chessboard.outbox_relay_commits
SET last_seq = :seq, committed_at = now()
WHERE transactional_id = :transactional_id AND last_seq < :seq
RETURNING last_seq;

-- name: claim_events(horizon, limit)
-- The oldest events, with the reason each one cannot be published (NULL when it can). No row
-- locks: lock_relay already makes this session the only publisher, and locking each event before
-- deleting it writes every row twice (measured: a third of the relay's throughput). Never SKIP
-- LOCKED: skipping a row would publish its key's next version before it.
-- The value and the topic-free checks were computed when the row was written (outbox_events'
-- generated columns, schema/outbox.sql);
-- only the registry's checks run here. The value leaves as UTF-8 bytea, so the binary cursor
-- hands Python the bytes Kafka sends. The message's timestamp is the row's creation time in
-- milliseconds (contract section 4: freshness is measured from the event, not from the broker's
-- append), and the traceparent of the recalc that wrote it becomes a header.
SELECT e.id, e.topic, e.message_key, convert_to(e.wire_value, 'UTF8') AS value,
       CASE
           WHEN t.topic IS NULL THEN 'unknown topic ' || e.topic
           WHEN e.defect IS NOT NULL THEN e.defect
           WHEN NOT e.payload ?& t.required_fields
               THEN 'payload misses ' || array_to_string(ARRAY(
                   SELECT f FROM unnest(t.required_fields) f WHERE NOT e.payload ? f), ', ')
       END AS error,
       (extract(epoch FROM e.created_at) * 1000)::bigint AS timestamp_ms,
       e.traceparent
FROM chessboard.outbox_events e
LEFT JOIN chessboard.outbox_topics t ON t.topic = e.topic
WHERE e.id <= :horizon
ORDER BY e.id
LIMIT :limit;

-- name: dead_letter_events(ids, errors)!
-- Moves rows aside with their error.
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
-- The rows of one Kafka transaction. Each [first, last] is a run of consecutive ids that were all
-- read and sent in it (ids are unique, so no row committed later falls inside one; see _id_runs in
-- outbox.py). The arrays are literals (see outbox.py).
DELETE FROM chessboard.outbox_events e
USING unnest(:firsts::bigint[], :lasts::bigint[]) AS r (first_id, last_id)
WHERE e.id BETWEEN r.first_id AND r.last_id;

-- name: count_runs(firsts, lasts, uptos)
-- Recovery: the rows of Kafka transactions that committed while their PostgreSQL transaction did
-- not, per topic, before delete_recovered removes them (a batch counts its rows from what it
-- read; RETURNING would slow every batch's delete for the sake of a rare recovery). A run's
-- `upto` is the newest created_at (epoch ms, as claim_events gives it) its receipt published:
-- after a failover the new primary may hand out the lost transactions' ids again, to rows made
-- after them, which no receipt published. NULL (an older receipt): no bound.
SELECT e.topic, count(*) AS events
FROM chessboard.outbox_events e
JOIN unnest(:firsts::bigint[], :lasts::bigint[], :uptos::bigint[]) AS r (first_id, last_id, upto)
    ON e.id BETWEEN r.first_id AND r.last_id
    AND (r.upto IS NULL OR (extract(epoch FROM e.created_at) * 1000)::bigint <= r.upto)
GROUP BY e.topic
ORDER BY e.topic;

-- name: delete_recovered(firsts, lasts, uptos)!
-- The rows count_runs counted.
DELETE FROM chessboard.outbox_events e
USING unnest(:firsts::bigint[], :lasts::bigint[], :uptos::bigint[]) AS r (first_id, last_id, upto)
WHERE e.id BETWEEN r.first_id AND r.last_id
    AND (r.upto IS NULL OR (extract(epoch FROM e.created_at) * 1000)::bigint <= r.upto);

-- name: record_events_beyond_source(transactional_id, events)!
-- Recovery, in its transaction: `events` of the receipts found were rows this database never
-- had (count_runs found fewer than the receipts name): their Versions are in Kafka only.
UPDATE chessboard.outbox_relay_commits
SET events_beyond_source = events_beyond_source + :events,
    beyond_source_since = coalesce(beyond_source_since, now())
WHERE transactional_id = :transactional_id;

-- name: count_relayed(topics, published, dead_lettered)!
-- Same transaction as the deletes: a counter never runs ahead of or behind the outbox. Rows are
-- upserted in topic order, so writers lock them in the same order.
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

-- name: events_beyond_source()$
-- Events Kafka holds beyond this database, over every relay identity, since the last repair.
SELECT coalesce(sum(events_beyond_source), 0)::bigint FROM chessboard.outbox_relay_commits;

-- name: relay_topics()
-- The topics the relay creates on the broker before its first batch.
SELECT topic FROM chessboard.outbox_topics ORDER BY topic;
