"""`pin db migrate`'s migrations wait at most MIGRATION_LOCK_TIMEOUT_MS for a lock: the bound
goes into the libpq options of the URL yoyo opens each migration's connection from, beside the
options the DSN already has."""

from __future__ import annotations

from yoyo.connections import parse_uri

from pin_pipelines.migrate import MIGRATION_LOCK_TIMEOUT_MS, _with_lock_timeout


def test_the_lock_timeout_is_added_to_the_urls_options() -> None:
    """Tried: a plain URL, and a multi-host one with options of its own (as with_driver writes
    it): yoyo reads lock_timeout in both, and every other parameter as it was."""
    bound = f"-c lock_timeout={MIGRATION_LOCK_TIMEOUT_MS}"
    plain = parse_uri(_with_lock_timeout("postgresql+psycopg://pin@127.0.0.1:5432/pin"))
    assert plain.args == {"options": bound}
    multi = parse_uri(
        _with_lock_timeout(
            "postgresql+psycopg://pin@/pin?host=a,b&port=1,2"
            "&options=-c%20statement_timeout%3D5s&sslmode=verify-full"
        )
    )
    assert multi.args == {
        "host": "a,b",
        "port": "1,2",
        "options": f"-c statement_timeout=5s {bound}",
        "sslmode": "verify-full",
    }
