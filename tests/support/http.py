"""HTTP probes of the servers tests start (the webserver, exporters, Prometheus, Alertmanager)."""

from __future__ import annotations

import urllib.request


def answers_http(url: str) -> bool:
    """`url` answers 200 now (anything else, or no answer within 5 s: False)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
