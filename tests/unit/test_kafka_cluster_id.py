"""KRaft cluster ids never start with "-": the storage tool would take one for an option."""

from __future__ import annotations

import base64

from pin_pipelines.stack.kafka import new_cluster_id


def test_cluster_ids_are_kafka_uuids_that_never_start_with_a_dash() -> None:
    """Tried: 5,000 ids (a leading "-" comes once in 64 from plain base64 of random bytes)."""
    ids = [new_cluster_id() for _ in range(5000)]
    assert all(not i.startswith("-") for i in ids)
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)
