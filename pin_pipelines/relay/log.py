"""Structured log lines of the relay: one JSON object per line on logger `pin_pipelines.relay`.

JSON so that a log shipper can index fields (topic, counts, lag) without parsing prose.
"""

from __future__ import annotations

import json
import logging

LOGGER = logging.getLogger("pin_pipelines.relay")


def log_event(level: int, event: str, **fields: object) -> None:
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, json.dumps({"event": event, **fields}, default=str, sort_keys=True))
