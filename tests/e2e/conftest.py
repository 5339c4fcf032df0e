"""The browser test runs `pin serve` on the test database of the integration tests."""

from tests.integration.conftest import db, pg_dsn

__all__ = ["db", "pg_dsn"]
