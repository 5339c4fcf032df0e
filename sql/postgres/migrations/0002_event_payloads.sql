-- Snapshot event payloads (contract section 4), built in SQL so the drain and the reconciliation
-- repair publish byte-for-byte the same shape.
-- depends: 0001_chessboard_schema

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

CREATE FUNCTION chessboard.layout_group_payload(g chessboard.layout_groups) RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT chessboard.event_envelope(g.id, g.version) || jsonb_build_object(
        'ProjectId', g.project_id,
        'TenantId', g.tenant_id,
        'Name', g.name,
        'SortOrder', g.sort_order,
        'IsArchived', g.is_archived,
        'LayoutsCount', g.layouts_count,
        'AreaMin', g.area_min,
        'AreaMax', g.area_max);
$$;
