"""`PIN_KAFKA_CONFIG`: the librdkafka properties (TLS, SASL) every Kafka client of the project
gets besides `bootstrap.servers` (contract section 8), and the operator's words for the failures
they can cause.

The file is read again whenever a client is made (`read_properties`), so a rotated credential
counts from the next run without a restart. It is checked before use: a line that is not
`key=value`, or a property librdkafka refuses, is one PinError naming the file, the line and the
key. librdkafka is the judge (a client made from the file alone, never connected), not a list
kept here; a file's text that passed is remembered, so the check costs once per content.

librdkafka reports why a connection failed (wrong password, untrusted certificate, a plaintext
client at a TLS port) only to the client's `error_cb`, while the call that failed says "Broker
transport failure" or "timed out". `Causes` keeps the first such cause per bootstrap address so
the one-line error names it (`failure`). Values never reach a message: errors quote keys only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Producer

from pin_pipelines.errors import PinError
from pin_pipelines.logs import log_event

ENV = "PIN_KAFKA_CONFIG"

#: Keys of confluent-kafka's Python callbacks: accepted by its constructors, not librdkafka's.
PYTHON_ONLY = frozenset(
    {"error_cb", "throttle_cb", "stats_cb", "logger", "on_delivery", "on_commit", "oauth_cb"}
)

log = logging.getLogger("pin_pipelines.kafka")


@dataclass(frozen=True)
class KafkaProperties:
    """The file's properties in order, and the line each key came from (for errors)."""

    source: str | None = None
    values: dict[str, str] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str) -> str:
        return f"{ENV} {self.source}: line {self.lines[key]}"


def parse(text: str, source: str) -> KafkaProperties:
    """`key=value` lines; `#` comments and blank lines skipped; a later key wins, as in Java."""
    values: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key = key.strip()
        if not equals or not key or any(c.isspace() for c in key):
            raise PinError(f"{ENV} {source}: line {number}: expected key=value")
        if key in PYTHON_ONLY:
            raise PinError(f"{ENV} {source}: line {number}: no such librdkafka property '{key}'")
        values[key] = value.strip()
        lines[key] = number
    return KafkaProperties(source, values, lines)


#: Digests of file contents that librdkafka accepted (a client is made per run: check once).
_accepted: set[str] = set()
_accepted_lock = threading.Lock()


def read_properties(environ: Mapping[str, str] | None = None) -> KafkaProperties:
    """The properties of the file at PIN_KAFKA_CONFIG, read now; none when it is unset."""
    path = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not path:
        return KafkaProperties()
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise PinError(f"{ENV} {path}: cannot be read ({why})") from exc
    properties = parse(text, path)
    digest = hashlib.sha256(f"{path}\0{text}".encode()).hexdigest()
    with _accepted_lock:
        known = digest in _accepted
    if not known:
        _check(properties)
        with _accepted_lock:
            _accepted.add(digest)
    return properties


class _NoLog:
    def log(self, *_args: Any) -> None:
        """librdkafka's warning about the missing bootstrap.servers of the check's client."""


#: librdkafka's refusals name the property: `No such configuration property: "x"`, `Invalid
#: value "v" for configuration property "x"`, `ssl.ca.location failed: ...`.
_NAMED = re.compile(r'property:? "([^"]+)"|^([a-z][a-z0-9_.]*) failed:')


def _check(properties: KafkaProperties) -> None:
    """Make (and drop) a client of the properties alone: librdkafka refuses an unknown property,
    a bad value or an unreadable certificate or key file here, never connecting anywhere."""
    try:
        Producer({**properties.values, "log_level": 0, "logger": _NoLog()})
    except KafkaException as exc:
        error = exc.args[0]
        text = error.str() if isinstance(error, KafkaError) else str(error)
        raise PinError(_refusal(properties, text)) from None
    except (TypeError, ValueError) as exc:  # confluent-kafka's own checks of a value
        raise PinError(f"{ENV} {properties.source}: {_scrub(properties, str(exc))}") from None


def _refusal(properties: KafkaProperties, text: str) -> str:
    text = text.removeprefix("Failed to create producer: ")
    found = _NAMED.search(text)
    key = (found.group(1) or found.group(2)) if found else None
    if key is None or key not in properties.lines:
        return f"{ENV} {properties.source}: librdkafka refuses it: {_scrub(properties, text)}"
    where = properties.where(key)
    if text.startswith("No such configuration property"):
        return f"{where}: no such librdkafka property '{key}'"
    if text.startswith("Invalid value"):
        return f"{where}: librdkafka refuses the value of '{key}'"
    return f"{where}: '{key}' {_scrub(properties, text.split(' failed: ', 1)[-1])}"


def _scrub(properties: KafkaProperties, text: str) -> str:
    """`text` without any of the file's values that could be a secret (every value longer
    than a few characters but file paths, which an operator needs to see)."""
    for key, value in properties.values.items():
        if len(value) >= 4 and not key.endswith(".location"):
            text = text.replace(value, "***")
    return text


class Causes:
    """The first cause librdkafka gave per bootstrap address, recorded by the clients' error_cb,
    cleared when a client of that address is made (a fixed credential must not keep the old
    cause). Process-wide: a wrong password fails every client of the estate alike.

    A plaintext connection closed at its first request is also what a broker that is shutting
    down does once: that cause (REQUIRES_TLS) counts from its third sighting, which a TLS port
    gives within a second or two of reconnects."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[str, str] = {}
        self._seen: dict[tuple[str, str], int] = {}

    def forget(self, bootstrap: str) -> None:
        with self._lock:
            self._first.pop(bootstrap, None)
            for key in [k for k in self._seen if k[0] == bootstrap]:
                del self._seen[key]

    def record(self, bootstrap: str, text: str) -> None:
        cause = operator_cause(text)
        if cause is None:
            return
        with self._lock:
            seen = self._seen[(bootstrap, cause)] = self._seen.get((bootstrap, cause), 0) + 1
            if cause != REQUIRES_TLS or seen >= 3:
                self._first.setdefault(bootstrap, cause)

    def first(self, bootstrap: str) -> str | None:
        with self._lock:
            return self._first.get(bootstrap)

    def callbacks(self, bootstrap: str) -> dict[str, Any]:
        """A client's `error_cb` and `logger`: librdkafka tells an authentication failure to
        the first, a TLS refusal or a plaintext client at a TLS port only in its log lines (at
        level 6, info). Both are kept as debug events, never printed."""

        def error_cb(error: KafkaError) -> None:
            log_event(log, "kafka_client_error", level=logging.DEBUG, error=error.str())
            self.record(bootstrap, error.str())

        return {"error_cb": error_cb, "logger": _ClientLog(self, bootstrap), "log_level": 6}


class _ClientLog:
    """librdkafka's log lines, as debug events (it would print them on stderr otherwise: a
    fenced producer's FATAL line next to the command's one-line error) and read for causes."""

    def __init__(self, causes: Causes, bootstrap: str) -> None:
        self.causes, self.bootstrap = causes, bootstrap

    def log(self, _level: int, fmt: str, *args: Any) -> None:
        line = fmt % args
        log_event(log, "kafka_client_log", level=logging.DEBUG, message=line)
        self.causes.record(self.bootstrap, line)


CAUSES = Causes()


#: A disconnect of a connection without TLS: librdkafka prefixes the others' addresses (ssl://).
_NOT_TLS = re.compile(r"(?:^|\s)(?:sasl_plaintext://)?[\w.\-]+:\d+/\w+: Disconnected")


REQUIRES_TLS = (
    f"the server requires TLS: set security.protocol=SSL or SASL_SSL in {ENV}"
    " (the port may also expect SASL)"
)


def operator_cause(text: str) -> str | None:
    """What the operator must fix, in their words, for a librdkafka error or log line that is
    not the network's; None for the others."""
    if "Unsupported SASL mechanism" in text or "mechanism handshake failed" in text:
        asked = re.search(r"SASL (\S+) mechanism handshake failed", text)
        offered = re.search(r"supported mechanisms: ([A-Z0-9_,\- ]+)", text)
        return (
            f"the broker does not offer SASL mechanism {asked.group(1) if asked else '?'}"
            + (f" (it offers {offered.group(1).strip()})" if offered else "")
            + f": set sasl.mechanism in {ENV}"
        )
    if "SASL authentication error" in text or "Authentication failed" in text:
        return f"authentication failed: check sasl.username and sasl.password in {ENV}"
    if "certificate verify failed" in text:
        return (
            "certificate not trusted: the broker's certificate is not signed by the CA of"
            f" ssl.ca.location in {ENV} (or does not name this host)"
        )
    if "connecting to a PLAINTEXT broker listener" in text:
        return (
            "the server does not use TLS at this port: check security.protocol in"
            f" {ENV} and the bootstrap address"
        )
    if "ssl/tls alert bad certificate" in text or "alert certificate required" in text:
        return (
            "the broker refused this client's certificate (or none was given): check"
            f" ssl.certificate.location and ssl.key.location in {ENV}"
        )
    tls_expected = "state APIVERSION_QUERY" in text and _NOT_TLS.search(text) is not None
    if tls_expected or "connecting to a SSL listener" in text:
        return REQUIRES_TLS
    if "SSL handshake failed" in text:
        return (
            "the TLS handshake failed (the broker may require a client certificate:"
            f" ssl.certificate.location and ssl.key.location in {ENV})"
        )
    return None


class _Polled(Protocol):
    def poll(self, timeout: float) -> Any: ...


def failure(bootstrap: str, otherwise: str, client: _Polled | None = None) -> str:
    """The one-line message of a failed Kafka call: the recorded cause when there is one (the
    call itself only saw a transport failure or a timeout), else the caller's `otherwise`.
    librdkafka hands its errors to error_cb only when the client is polled: `client`, the one
    whose call failed, is polled once first (a consumer of a failed load may drop a message
    there; the load fails without committing it)."""
    if client is not None:
        with contextlib.suppress(KafkaException, RuntimeError):
            client.poll(0)
    cause = CAUSES.first(bootstrap)
    return f"Kafka at {bootstrap}: {cause}" if cause else otherwise
