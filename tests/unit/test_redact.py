"""Secrets never shown: every URL form the project prints loses its password and secret params."""

from __future__ import annotations

import pytest

from pin_pipelines.redact import redact_url


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "postgresql://pin:s3cr%40t@a:5432,b:5433/pin?sslmode=verify-full&password=x",
            "postgresql://pin:***@a:5432,b:5433/pin?sslmode=verify-full&password=***",
        ),
        (
            "clickhouses://writer:pw@127.0.0.1:9440/pin_dev_stats?verify=true",
            "clickhouses://writer:***@127.0.0.1:9440/pin_dev_stats?verify=true",
        ),
        ("host=a password=abc dbname=pin", "host=a password=*** dbname=pin"),
        ("host=a password='a b\\'c' dbname=pin", "host=a password=*** dbname=pin"),
        (
            "at postgresql+psycopg2://u:p@h/dagster: refused",
            "at postgresql+psycopg2://u:***@h/dagster: refused",
        ),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("chdb:///var/lib/pin/chdb", "chdb:///var/lib/pin/chdb"),
        ("sasl.password=hunter2", "sasl.password=***"),
    ],
)
def test_secrets_are_masked(text: str, shown: str) -> None:
    assert redact_url(text) == shown
