-- depends: 0022_layout_group_follows_project
-- The relay is woken at the commit of every transaction that wrote the outbox, instead of
-- polling it every 0.1 s (864,000 statements a day at rest): it LISTENs on
-- chessboard_outbox_events (queries/outbox.sql, listen_outbox) and polls only as a backstop.
-- One notification per transaction, never one per row: NOTIFY takes a global lock at commit (a
-- cluster-wide one, held until the commit is done, so the commits of notifying transactions
-- queue behind each other), and PostgreSQL sends identical notifications of one transaction
-- once. A statement-level trigger with an empty payload calls pg_notify once per INSERT
-- statement (not once per row of the drain's multi-row insert) and every call of one
-- transaction is the same notification, so the relay gets one per transaction.
-- Online: a new function, and a trigger whose SHARE ROW EXCLUSIVE lock the relay's batch waits
-- for only as long as the statement runs (sql/postgres/schema/README.md).
CREATE FUNCTION chessboard.outbox_events_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('chessboard_outbox_events', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_events_notify AFTER INSERT ON chessboard.outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION chessboard.outbox_events_notify();
