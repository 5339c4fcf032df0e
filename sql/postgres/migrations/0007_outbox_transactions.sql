-- depends: 0005_outbox_wire_text
-- The relay writes Kafka transactions: one relay publishes at a time, and each
-- transaction carries a receipt that says, after a crash, whether it committed.
--
-- One publisher: a relay holds a session advisory lock on the outbox while it holds its
-- transactional producer (lock_relay in sql/postgres/queries/outbox.sql), so the per-key buckets
-- that let several relays publish side by side are gone. Dropping the column drops its index.
ALTER TABLE chessboard.outbox_events DROP COLUMN key_bucket;
DROP TABLE chessboard.outbox_buckets;

-- Per transactional.id: the seq of the last Kafka transaction whose rows were deleted. Every
-- transaction also writes a receipt {seq, id runs} to pin.chessboard.outbox-relay-commits.v1; a new
-- relay that finds a receipt with a higher seq knows that transaction committed in Kafka although
-- its rows were not deleted (a crash between the two commits), and deletes them then.
-- outbox_id is part of the receipts' key: a database dropped and created again, or another
-- database whose relay uses the same transactional.id on the same Kafka, never takes another
-- outbox's receipt for its own (its ids would name unrelated rows).
CREATE TABLE chessboard.outbox_relay_commits (
    transactional_id text PRIMARY KEY,
    outbox_id uuid NOT NULL DEFAULT gen_random_uuid(),
    last_seq bigint NOT NULL DEFAULT 0,
    committed_at timestamptz
);
