-- depends: 0003_outbox_relay
-- The outbox row carries what the relay sends, computed once when the event is written.
--
-- Rendering each jsonb payload as text and checking its shape while the relay reads took more
-- PostgreSQL time than the whole send to Kafka (bench/bench_relay.py: 1.2 s of a 2.0 s relay of
-- 200k events). Stored generated columns move that work into the writing transaction (the drain's,
-- about 5 µs per event) and keep it right by construction: PostgreSQL recomputes them whenever
-- the row changes, so they cannot disagree with `payload`. (A later migration that changes
-- outbox_event_defect must also rewrite the rows: `UPDATE ... SET payload = payload`.) `payload`
-- stays jsonb and stays the source: what operators query and what the dead-letter table keeps.

-- What is wrong with an event on its own, whatever its topic; NULL when nothing is. The checks
-- that depend on the topic registry (unknown topic, missing fields) stay in the relay's read
-- (claim_events in sql/postgres/queries/outbox.sql), where a registry change takes effect at once.
-- IMMUTABLE is true here: the result depends only on the arguments.
CREATE FUNCTION chessboard.outbox_event_defect(message_key text, payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN jsonb_typeof(payload) <> 'object'
        THEN 'payload is a JSON ' || jsonb_typeof(payload) || ', not an object'
    -- The envelope every snapshot event carries (contract section 4); the registry's per-topic
    -- fields are checked by the relay.
    WHEN NOT payload ?& '{ContractVersion,EventId,CreatedAt,Id,Version}'
        THEN 'payload misses ' || array_to_string(ARRAY(
            SELECT f FROM unnest('{ContractVersion,EventId,CreatedAt,Id,Version}'::text[]) f
            WHERE NOT payload ? f), ', ')
    -- The integer 1 as written: jsonb equality would also take 1.0, which is sent as written
    -- and which the contract's consumers refuse.
    WHEN jsonb_typeof(payload -> 'ContractVersion') IS DISTINCT FROM 'number'
         OR payload ->> 'ContractVersion' <> '1'
        THEN 'ContractVersion is not 1'
    WHEN jsonb_typeof(payload -> 'Version') IS DISTINCT FROM 'number'
         OR payload ->> 'Version' !~ '^[1-9][0-9]*$'
        THEN 'Version is not a positive integer'
    WHEN payload ->> 'Id' IS DISTINCT FROM message_key
        THEN 'message_key differs from payload Id'
    WHEN message_key !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
        THEN 'message_key is not a lowercase UUID'
END
$$;

ALTER TABLE chessboard.outbox_events
    -- The Kafka message value: jsonb's canonical text (valid JSON, one line, keys sorted by jsonb).
    ADD COLUMN wire_value text NOT NULL GENERATED ALWAYS AS (payload::text) STORED,
    ADD COLUMN defect text GENERATED ALWAYS AS (
        chessboard.outbox_event_defect(message_key, payload)) STORED;
