"""The payload of each topic the project publishes, described once: a JSON Schema per topic in
this folder, `<topic>.schema.json` (contract section 4).

The schemas are the event contracts as files: what a consumer may rely on, with the types the
SQL that builds the payloads (sql/postgres/schema/outbox.sql) gives them. Each one's `required`
is the relay's gate too (`chessboard.outbox_topics.required_fields`, kept equal by a test), and a
change to one must be additive (new optional properties, nothing removed or narrowed) unless its
ContractVersion changes: `python -m tests.support.contract_changes` checks every version of each
schema in the repository's history against the one before (bin/test runs it).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(__file__).resolve().parent
SUFFIX = ".schema.json"


def contract_topics() -> list[str]:
    """The topics with a contract, in name order."""
    return sorted(path.name.removesuffix(SUFFIX) for path in SCHEMA_DIR.glob(f"*{SUFFIX}"))


def schema_path(topic: str) -> Path:
    return SCHEMA_DIR / f"{topic}{SUFFIX}"


@cache
def schema(topic: str) -> dict[str, Any]:
    """The JSON Schema of `topic`'s payload (KeyError for a topic without one)."""
    path = schema_path(topic)
    if not path.exists():
        raise KeyError(f"no contract for topic {topic!r} ({path.name} in {SCHEMA_DIR})")
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def required_fields(topic: str) -> list[str]:
    """The fields every payload of `topic` carries."""
    return list(schema(topic)["required"])
