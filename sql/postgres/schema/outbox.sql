-- The transactional outbox: the drain writes snapshot events in the same transaction as the
-- aggregates; the relay publishes them after commit, as Kafka transactions, and deletes them
-- once Kafka committed. Also the snapshot builders both the drain and the reconciliation's
-- re-publish use, so the two publish byte-for-byte the same shape (contract section 4).

-- What is wrong with an event on its own, whatever its topic; NULL when nothing is. The checks
-- that depend on the topic registry (unknown topic, missing fields) stay in the relay's read
-- (claim_events in queries/outbox.sql), where a registry change takes effect at once.
-- IMMUTABLE is true: the result depends only on the arguments. A plain CASE expression with a
-- SQL-standard body (stored as a parse tree, no sub-query): the planner inlines it into the
-- generated column below instead of parsing and running a query per row. Changing what it
-- returns means rewriting the stored rows (`UPDATE ... SET payload = payload`).
CREATE FUNCTION chessboard.outbox_event_defect(message_key text, payload jsonb)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN jsonb_typeof(payload) <> 'object'
        THEN 'payload is a JSON ' || jsonb_typeof(payload) || ', not an object'
    -- The envelope every snapshot event carries (contract section 4); the registry's per-topic
    -- fields are checked by the relay.
    WHEN NOT payload ?& '{ContractVersion,EventId,CreatedAt,Id,Version}'
        -- Each missing field as ", <name>", the first comma cut off. (array_to_string and
        -- concat_ws are STABLE: in an IMMUTABLE function's body they would stop the inlining.)
        THEN 'payload misses ' || substr(
            CASE WHEN payload ? 'ContractVersion' THEN '' ELSE ', ContractVersion' END
            || CASE WHEN payload ? 'EventId' THEN '' ELSE ', EventId' END
            || CASE WHEN payload ? 'CreatedAt' THEN '' ELSE ', CreatedAt' END
            || CASE WHEN payload ? 'Id' THEN '' ELSE ', Id' END
            || CASE WHEN payload ? 'Version' THEN '' ELSE ', Version' END, 3)
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
END;

-- The row carries what the relay sends, computed once when the event is written: stored
-- generated columns move the rendering and the checks into the writing transaction (a few µs
-- per event) instead of the relay's read, where they cost more than the send to Kafka, and
-- PostgreSQL keeps them equal to `payload`, which stays the source (what operators query and
-- what the dead-letter table keeps).
CREATE TABLE chessboard.outbox_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    message_key text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The Kafka message value: jsonb's canonical text (valid JSON, one line).
    wire_value text NOT NULL GENERATED ALWAYS AS (payload::text) STORED,
    defect text GENERATED ALWAYS AS (chessboard.outbox_event_defect(message_key, payload)) STORED,
    -- The W3C traceparent of the recalc that wrote the event (NULL when nothing is traced): the
    -- relay sends it as a Kafka header, so the loader's span links back to the project's span.
    traceparent text
);

-- Wakes the relay at the commit of every transaction that wrote the outbox: the relay LISTENs on
-- chessboard_outbox_events (queries/outbox.sql, listen_outbox) and polls only as a backstop.
-- One notification per transaction, never one per row: NOTIFY takes a global lock at commit (a
-- cluster-wide one, held until the commit is done, so the commits of notifying transactions
-- queue behind each other), and PostgreSQL sends identical notifications of one transaction
-- once. Statement-level with an empty payload: pg_notify runs once per INSERT statement (not
-- per row of the drain's multi-row insert), and every call of one transaction is the same
-- notification.
CREATE FUNCTION chessboard.outbox_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('chessboard_outbox_events', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_events_notify AFTER INSERT ON chessboard.outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.outbox_events_notify();

-- The topics the relay may publish and the payload fields each requires (contract section 4):
-- each topic's contract, pin_pipelines/contracts/<topic>.schema.json, its `required` (kept equal
-- by tests/integration/test_event_contracts.py). An outbox row for another topic or without
-- these fields is dead-lettered, never published.
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

-- One relay publishes at a time (a session advisory lock: lock_relay in queries/outbox.sql).
-- Per transactional.id: the seq of the last Kafka transaction whose rows were deleted. Every
-- transaction also writes a receipt {seq, id runs} to pin.chessboard.outbox-relay-commits.v1; a
-- new relay that finds a receipt with a higher seq knows that transaction committed in Kafka
-- although its rows were not deleted (a crash between the two commits), and deletes them then.
-- outbox_id is part of the receipts' key: a database created again, or another database whose
-- relay uses the same transactional.id on the same Kafka, never takes another outbox's receipt
-- for its own (its ids would name unrelated rows).
-- events_beyond_source: events of receipts whose rows this database never had (a failover to a
-- lagging standby, a restore from a backup): Versions Kafka holds beyond the source, which the
-- source will issue again with other content. Added by the recovery since beyond_source_since,
-- set back to 0 by `pin reconcile --repair`; served as chessboard_outbox_events_beyond_source.
CREATE TABLE chessboard.outbox_relay_commits (
    transactional_id text PRIMARY KEY,
    outbox_id uuid NOT NULL DEFAULT gen_random_uuid(),
    last_seq bigint NOT NULL DEFAULT 0,
    committed_at timestamptz,
    events_beyond_source bigint NOT NULL DEFAULT 0,
    beyond_source_since timestamptz
);

-- ---------------------------------------------------------------------------------------------
-- Snapshot event payloads (contract section 4).

-- Envelope shared by every snapshot event. CreatedAt is clock time, not transaction start: it is
-- the dimension's ReplacingMergeTree version, and it must grow per key in commit order.
CREATE FUNCTION chessboard.event_envelope(id uuid, version bigint) RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT jsonb_build_object(
        'ContractVersion', 1,
        'EventId', gen_random_uuid(),
        'CreatedAt', to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
        'Id', id,
        'Version', version);
$$;

-- The entity fields of each event. The aggregates are parameters: the drain compares the
-- snapshot with the values it is about to write, in the same statement that writes them.
-- STABLE, as jsonb_build_object is: the planner inlines them as an expression of the row (it
-- refuses to inline an IMMUTABLE function whose body calls a STABLE one, and would then run the
-- body as a query per row). Nothing needs them IMMUTABLE: no index or generated column uses
-- them, and no timestamptz (whose text follows the session's TimeZone) is among their inputs.
CREATE FUNCTION chessboard.project_snapshot(
    p chessboard.projects, total_count int, free_count int, price_min numeric, price_max numeric
) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'TenantId', p.tenant_id,
        'Name', p.name,
        'Status', p.status,
        'PriceMin', price_min,
        'PriceMax', price_max,
        'PropertyObjectsTotalCount', total_count,
        'PropertyObjectsFreeCount', free_count);
$$;

CREATE FUNCTION chessboard.layout_snapshot(l chessboard.layouts, objects_count int)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'ProjectId', l.project_id,
        'LayoutGroupId', l.layout_group_id,
        'Name', l.name,
        'TotalArea', l.total_area,
        'PropertyObjectsCount', objects_count,
        'IsDeleted', l.deleted_at IS NOT NULL);
$$;

CREATE FUNCTION chessboard.layout_group_snapshot(
    g chessboard.layout_groups, layouts_count int, area_min numeric, area_max numeric
) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'ProjectId', g.project_id,
        'TenantId', g.tenant_id,
        'Name', g.name,
        'SortOrder', g.sort_order,
        'IsArchived', g.is_archived,
        'LayoutsCount', layouts_count,
        'AreaMin', area_min,
        'AreaMax', area_max);
$$;

-- The reconciliation's re-publish builds the same event from the row as stored.
CREATE FUNCTION chessboard.layout_group_payload(g chessboard.layout_groups)
RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT chessboard.event_envelope(g.id, g.version)
           || chessboard.layout_group_snapshot(g, g.layouts_count, g.area_min, g.area_max);
$$;
