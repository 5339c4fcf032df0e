-- depends: 0019_group_roles
-- Events Kafka holds whose PostgreSQL transactions are gone: after a failover to an
-- asynchronous standby that lacked the primary's last transactions (or a restore from a
-- backup), the relay's recovery finds receipts of batches whose rows the database never had.
-- Each such event is a Version the source will issue again with other content, which a
-- consumer's version guard (the dimension's loader) skips. The recovery adds them here; `pin
-- reconcile --repair` re-publishes the drifted groups above every version and sets it back to 0.
-- `pin metrics serve` serves the sum (chessboard_outbox_events_beyond_source) and
-- CHESSBOARD_KAFKA_AHEAD_OF_SOURCE pages on it.
-- Online: two columns with constant defaults, no rewrite (sql/postgres/schema/README.md).
ALTER TABLE chessboard.outbox_relay_commits
    ADD COLUMN events_beyond_source bigint NOT NULL DEFAULT 0,
    ADD COLUMN beyond_source_since timestamptz;
