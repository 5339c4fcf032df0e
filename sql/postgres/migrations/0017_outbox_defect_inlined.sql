-- depends: 0016_recalc_nothing_to_publish
-- outbox_event_defect (migration 0005) as an expression the planner inlines, its body parsed
-- once, here. The same checks, in the same order, with the same messages: the rows
-- already stored need no rewrite.
--
-- Its text body listed missing fields with a sub-SELECT, and the planner inlines no function
-- with a sub-query: every statement that writes outbox rows (a project's INSERT of its events,
-- `pin reconcile`'s republish) prepared the `defect` column at its executor start by parsing
-- the body's text to try inlining it, then, at the first row, parsing and planning it again as a
-- query of its own, run once per row. Now the missing fields are a plain text expression, and
-- the body is SQL-standard (RETURN): stored as a parse tree, so an inlining reads it instead of
-- parsing text, and each row evaluates one CASE expression.
CREATE OR REPLACE FUNCTION chessboard.outbox_event_defect(message_key text, payload jsonb)
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
