-- depends: 0008_published_snapshots
-- The W3C traceparent of the recalc that wrote an event (NULL when nothing is traced): the relay
-- sends it as a Kafka header, so the loader's span links back to the project's span.
ALTER TABLE chessboard.outbox_events ADD COLUMN traceparent text;
