"""A receipt names the rows its Kafka transaction published: the id runs and, since failover
recovery needs it, the newest created_at of those rows (a row created later under one of the
ids, as a failed-over primary's sequence hands them out again, is another row). Receipts
written before that field decode with no bound."""

from __future__ import annotations

import json

from pin_pipelines.relay.receipts import Receipt, decode, encode


def test_a_receipt_round_trips_with_its_created_bound() -> None:
    assert decode(encode(7, [1, 10], [5, 12], 1_700_000_000_123)) == Receipt(
        7, [1, 10], [5, 12], 1_700_000_000_123
    )


def test_an_older_receipt_has_no_bound() -> None:
    older = json.dumps({"seq": 3, "first_ids": [1], "last_ids": [4]}).encode()
    assert decode(older) == Receipt(3, [1], [4], None)


def test_a_receipt_counts_every_id_of_its_runs() -> None:
    """What the recovery compares with the rows it finds: fewer rows than events means the
    database lost the transactions that wrote them (events beyond the source)."""
    assert Receipt(7, [1, 10, 20], [5, 12, 20]).events == 5 + 3 + 1
    assert Receipt(8, [], []).events == 0
