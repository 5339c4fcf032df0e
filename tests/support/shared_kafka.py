"""The Kafka broker of `pin stack up` (127.0.0.1:9092 unless PIN_KAFKA_BOOTSTRAP says otherwise),
shared by every test session on the machine: tests on it use topics and groups of their own. The
modules that kill a broker, or need a group or topic configuration no other session shares, use
the session's private broker instead (tests/support/private_kafka.py).

Registered for every test by `pytest_plugins` in tests/conftest.py: the fixture asks the broker
only when a test takes it. The default address is put in the environment only by the conftests of
tests/integration and tests/e2e (`use_shared_broker`), never for tests/unit.
"""

from __future__ import annotations

import os

import pytest

from pin_pipelines.kafka import broker_answers


def use_shared_broker() -> None:
    """PIN_KAFKA_BOOTSTRAP, unless set already, is the broker of `pin stack up`."""
    os.environ.setdefault("PIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The real broker of `pin stack up`; a missing broker fails here, clearly."""
    bootstrap = os.environ["PIN_KAFKA_BOOTSTRAP"]
    assert broker_answers(bootstrap, timeout=10), f"Kafka at {bootstrap} does not answer"
    return bootstrap
