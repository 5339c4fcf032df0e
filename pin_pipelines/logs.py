"""Structured JSON log lines with the spec's event names (one object per line)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from pin_pipelines.redact import redact_url

#: Marks a record whose message `log_event` redacted already, so the formatter does not scan a
#: drain's line per project twice.
_REDACTED = "pin_redacted"


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    if not logger.isEnabledFor(level):
        return
    record = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
    # Whatever a field holds (an error quoting a URL), no password reaches the log.
    line = redact_url(json.dumps(record, default=str, ensure_ascii=False))
    logger.log(level, line, extra={_REDACTED: True})


def configure_cli_logging(level: int = logging.INFO) -> None:
    """Logs go to stderr, so a command's stdout stays a clean JSON summary."""
    _log_to(sys.stderr, level)


def configure_run_logging(level: int = logging.INFO) -> None:
    """In a Dagster run: the JSON lines go to the run's stdout, which Dagster captures as its
    compute logs (shown in the UI), never to the event log: a line per project or message
    would make the event log grow with the queue."""
    _log_to(sys.stdout, level)


class _RedactingFormatter(logging.Formatter):
    """The message with every URL's password masked: a field holding a DSN or a driver's error
    that quotes one must not put a secret into a log line, whoever logged it."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return line if getattr(record, _REDACTED, False) else redact_url(line)


def _log_to(stream: TextIO, level: int) -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_RedactingFormatter("%(message)s"))
    root = logging.getLogger("pin_pipelines")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
