"""Secrets kept out of every message: a URL or DSN is shown with its password and any secret
parameter replaced by `***`, wherever the project prints, logs or stores one.

One function for every service's URL (libpq, clickhouse-driver, Dagster's SQLAlchemy URL), since
a redaction written per module missed the ones it was not written for.
"""

from __future__ import annotations

import re

MASK = "***"
#: Parameter names whose values are secrets, in a URL's query or a libpq `key=value` string.
SECRET_KEYS = ("password", "sslpassword", "ssl.key.password", "sasl.password")

_USERINFO_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/?#@:]*:)[^/?#@]*(?=@)", re.I)
_SECRET_PARAM = re.compile(
    r"(?P<head>(?:^|[?&;\s])(?:" + "|".join(re.escape(k) for k in SECRET_KEYS) + r")\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|[^&;\s]*)",
    re.I,
)


def redact_url(text: str) -> str:
    """`text` (a URL, a libpq key=value DSN, or a message holding either) without secrets.

    Every log line passes here (a drain's line per project too): a line that can hold neither
    form is returned after two substring tests, since the patterns cost ~50 us a line."""
    if "://" in text and "@" in text:
        text = _USERINFO_PASSWORD.sub(lambda m: m.group("head") + MASK, text)
    if "password" in text.lower():
        text = _SECRET_PARAM.sub(lambda m: m.group("head") + MASK, text)
    return text
