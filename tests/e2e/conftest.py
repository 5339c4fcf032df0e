"""The browser test runs `pin serve` on the test database of the integration tests (the `pg_dsn`
and `db` fixtures of tests/support/database.py), with `pin`'s environment pointed at the test
services as tests/integration/conftest.py points it."""

from tests.support.database import use_test_database
from tests.support.shared_kafka import use_shared_broker

use_test_database()
use_shared_broker()
