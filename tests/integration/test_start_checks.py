"""Bad settings found at the start (issue 49): every worker reaches each service it will need
before it does anything, even with nothing to do, and a wrong password or an unreachable peer
(a refused port) ends it within its bounded waits, with one line naming the service and the
cause, never the password.

Before, a worker with nothing to do never touched some of its services and reported success:
`pin devstats load --once` with a wrong ClickHouse password and nothing new in the topic exited
0, `complete`; `pin outbox relay --once` with an empty outbox and an unreachable Kafka exited 0;
the continuous loader, the continuous relay and `pin metrics serve` ran on as if all was well.

The loader's cases run on the session's private broker: its topic must be empty, and without
the check the load joins the product's consumer group, which on the shared broker is every other
session's `pin serve`'s.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from pin_pipelines.devstats.offsets import DEFAULT_GROUP
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import free_port
from tests.support.cli import PIN, assert_one_line_error, finish
from tests.support.devstats import committed

#: CONTRACT section 8: a wrong credential ends a command with one line within 60 s.
FAILURE_SECONDS = 60.0
#: A password the ClickHouse server's `default` user does not have.
WRONG_PASSWORD = "not-the-password-7f3a"
#: Nothing listens on port 1: every connection is refused at once.
REFUSED_KAFKA = "127.0.0.1:1"


def _started(args: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`pin ARGS` in `env`, with the time bound of the contract: a worker that does not end by
    itself (a continuous one that ran on) fails the test as hung."""
    started = time.monotonic()
    process = subprocess.Popen(
        [PIN, *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done = finish(process, FAILURE_SECONDS)
    assert time.monotonic() - started < FAILURE_SECONDS
    return done


def _wrong_password(url: str) -> str:
    """`url` (a clickhouse://user@host URL of the test server) with a password the user has not."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user.split(':')[0]}:{WRONG_PASSWORD}@{host}"


@pytest.mark.parametrize("once", [True, False], ids=["once", "continuous"])
@pytest.mark.parametrize(
    ("case", "cause"),
    [("wrong-password", "authentication failed"), ("refused-port", "is unreachable")],
)
def test_a_loader_with_nothing_to_load_checks_clickhouse_at_its_start(
    kafka: LocalKafka,
    clickhouse_server_url: str,
    tmp_path: Path,
    once: bool,
    case: str,
    cause: str,
) -> None:
    """Tried: `pin devstats load --once` and the continuous `pin devstats load` with nothing in
    the layout-group topic (the module's broker as new), against the ClickHouse server with a
    wrong password for its user, or at a port nobody listens on. Before, the cycle exited 0
    with `complete: true` and the continuous load ran on, idle (still running after 60 s):
    ClickHouse was first reached at the first batch. Now each ends non-zero with one line
    naming the loader, ClickHouse at its address and the cause, no password in it, and the
    group commits nothing."""
    bootstrap = kafka.settings.kafka_bootstrap
    if case == "wrong-password":
        url = _wrong_password(clickhouse_server_url)
        address = url.rsplit("@", 1)[1].split("/")[0]
    else:
        address = f"127.0.0.1:{free_port()}"
        url = f"clickhouse://default@{address}/pin_dev_stats"
    env = {
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        "PIN_CLICKHOUSE_URL": url,
        "PIN_STATE_DIR": str(tmp_path / "state"),
    }

    result = _started(("devstats", "load", *(["--once"] if once else [])), env)

    assert_one_line_error(result, "the dimension loader cannot start", "ClickHouse", address, cause)
    assert WRONG_PASSWORD not in result.stdout + result.stderr
    assert all(o < 0 for o in committed(bootstrap, TOPIC_LAYOUT_GROUP, DEFAULT_GROUP).values())


@pytest.mark.parametrize("once", [True, False], ids=["once", "continuous"])
def test_a_relay_with_an_empty_outbox_checks_kafka_at_its_start(
    outbox: psycopg.Connection, tmp_path: Path, once: bool
) -> None:
    """Tried: `pin outbox relay --once` and the continuous `pin outbox relay` with an empty
    outbox and PIN_KAFKA_BOOTSTRAP at a refused port. Before, the cycle exited 0 with
    `published: 0` and the continuous relay ran on, polling (still running after 60 s): an empty
    outbox touched no broker. Now each ends non-zero with one line naming the relay, Kafka at
    that address and the cause."""
    env = {"PIN_KAFKA_BOOTSTRAP": REFUSED_KAFKA, "PIN_STATE_DIR": str(tmp_path / "state")}

    result = _started(("outbox", "relay", *(["--once"] if once else [])), env)

    assert_one_line_error(
        result, "the outbox relay cannot start", f"Kafka at {REFUSED_KAFKA}", "unreachable"
    )


def test_a_relay_with_an_unreachable_postgres_names_both_failures(tmp_path: Path) -> None:
    """Tried: `pin outbox relay --once` with PostgreSQL and Kafka both at refused ports. One
    line names both services and their causes (every check runs), not only the first."""
    env = {
        "PIN_PG_DSN": f"postgresql://postgres@127.0.0.1:{free_port()}/pin",
        "PIN_KAFKA_BOOTSTRAP": REFUSED_KAFKA,
        "PIN_STATE_DIR": str(tmp_path / "state"),
    }

    result = _started(("outbox", "relay", "--once"), env)

    assert_one_line_error(
        result, "the outbox relay cannot start", "PostgreSQL at", f"Kafka at {REFUSED_KAFKA}"
    )


def test_the_exporter_checks_kafka_at_its_start(pg_dsn: str) -> None:
    """Tried: `pin metrics serve` with a reachable PostgreSQL and PIN_KAFKA_BOOTSTRAP at a
    refused port. Before, it served (the loader's families missing, `pin_metrics_source_up
    {source="kafka"} 0` on every scrape) and ran until stopped; now it ends non-zero with one
    line naming the exporter and Kafka."""
    env = {"PIN_PG_DSN": pg_dsn, "PIN_KAFKA_BOOTSTRAP": REFUSED_KAFKA}

    result = _started(("metrics", "serve", "--port", "0"), env)

    assert_one_line_error(result, "the metrics exporter cannot start", f"Kafka at {REFUSED_KAFKA}")


def test_the_drain_checks_postgres_at_its_start(tmp_path: Path) -> None:
    """Tried: `pin recalc drain --once` with PIN_PG_DSN at a refused port: one line naming
    PostgreSQL at that address (the drain's only service: it already connected first thing;
    this keeps it so, beside test_pg_secured's wrong-password case)."""
    port = free_port()
    env = {
        "PIN_PG_DSN": f"postgresql://postgres@127.0.0.1:{port}/pin",
        "PIN_STATE_DIR": str(tmp_path / "state"),
    }

    result = _started(("recalc", "drain", "--once"), env)

    assert_one_line_error(result, f"PostgreSQL at postgresql://postgres@127.0.0.1:{port}/pin")
