"""The identity provider's signing keys (its JWKS at PIN_API_JWKS_URL), fetched and cached.

Tokens name their key by `kid`. The cache is read on every request and refreshed:
- when a token names a kid it does not hold (the provider rotated its keys), at most once per
  MIN_REFRESH_SECONDS whatever the tokens say, and never waited for by a second request: a
  stream of tokens with made-up kids costs the provider one fetch per interval, and the API no
  blocked threads;
- every MAX_AGE_SECONDS by the server's main loop (`refresh_if_stale`), so a key the provider
  withdrew stops being accepted within that bound, and a new one is usually known before the
  first token signed with it arrives (docs/runbook.md, "Rotating the identity provider's keys").
A refresh that fails, or finds no usable key, keeps the keys held (and is logged): an outage of
the provider does not lock every developer out. The first fetch (`load`) must succeed: a service
that could verify nothing would only answer 401.

Only RS256 and ES256 keys are kept (the contract's algorithms): an RSA key of at least 2,048 bits,
or an EC key on P-256, with a kid, `use` absent or `sig`, `alg` absent or matching. Each key is
bound to its algorithm, and a token is verified with its key's algorithm only, so a token cannot
choose how it is checked (`alg: none`, HS256 keyed with the public key).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt import PyJWK
from jwt.exceptions import PyJWTError

from pin_pipelines.errors import PinError
from pin_pipelines.logs import log_event
from pin_pipelines.redact import redact_url

log = logging.getLogger("pin_pipelines.api")

ALGORITHMS = ("RS256", "ES256")
#: How long a fetch of the JWKS may take (connect and read).
FETCH_TIMEOUT_SECONDS = 5.0
#: A JWKS holds a handful of keys; anything much larger is not one.
MAX_JWKS_BYTES = 1024 * 1024
#: Unknown kids refresh the keys at most this often.
MIN_REFRESH_SECONDS = 10.0
#: Keys are fetched again when they are older than this, unknown kid or not.
MAX_AGE_SECONDS = 300.0
_MIN_RSA_BITS = 2048


class JwksUnavailable(PinError):
    """The JWKS could not be fetched or holds no usable key."""


@dataclass(frozen=True)
class SigningKey:
    """A public key of the provider and the one algorithm tokens signed with it may use."""

    kid: str
    algorithm: str
    key: Any


def fetch_jwks(url: str, timeout: float = FETCH_TIMEOUT_SECONDS) -> dict[str, SigningKey]:
    """The usable keys of the JWKS at `url`, by kid; JwksUnavailable when none can be had."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    shown = redact_url(url)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read(MAX_JWKS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise JwksUnavailable(f"the JWKS at {shown} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise JwksUnavailable(f"cannot fetch the JWKS at {shown}: {reason}") from exc
    if len(body) > MAX_JWKS_BYTES:
        raise JwksUnavailable(f"the JWKS at {shown} is larger than {MAX_JWKS_BYTES} bytes")
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise JwksUnavailable(f"the JWKS at {shown} is not JSON") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise JwksUnavailable(f"the JWKS at {shown} has no `keys` list")
    keys = {key.kid: key for key in map(_signing_key, entries) if key is not None}
    if not keys:
        raise JwksUnavailable(
            f"the JWKS at {shown} holds no RS256 or ES256 signing key with a kid "
            f"({len(entries)} keys)"
        )
    return keys


def _signing_key(jwk: object) -> SigningKey | None:
    """A JWK the API may verify with, or None (skipped)."""
    if not isinstance(jwk, dict):
        return None
    kid, kty = jwk.get("kid"), jwk.get("kty")
    expected = {"RSA": "RS256", "EC": "ES256"}.get(kty) if isinstance(kty, str) else None
    if not isinstance(kid, str) or not kid or expected is None:
        return None
    if jwk.get("use", "sig") != "sig" or jwk.get("alg", expected) != expected:
        return None
    if kty == "EC" and jwk.get("crv") != "P-256":
        return None
    try:
        key = PyJWK(jwk, algorithm=expected).key
    except (PyJWTError, ValueError, TypeError, KeyError):
        return None
    if isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        key = key.public_key()  # a provider that published a private part: verify with the public
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < _MIN_RSA_BITS:
        return None
    return SigningKey(kid, expected, key)


class JwksCache:
    """The keys of one JWKS, thread-safe (the API verifies on its worker threads)."""

    def __init__(
        self,
        url: str,
        *,
        fetch: Callable[[str], Mapping[str, SigningKey]] = fetch_jwks,
        clock: Callable[[], float] = time.monotonic,
        min_refresh_seconds: float = MIN_REFRESH_SECONDS,
        max_age_seconds: float = MAX_AGE_SECONDS,
    ) -> None:
        self.url = url
        self._fetch = fetch
        self._clock = clock
        self.min_refresh_seconds = min_refresh_seconds
        self.max_age_seconds = max_age_seconds
        self._keys: Mapping[str, SigningKey] = {}
        self._fetched_at = float("-inf")
        self._attempted_at = float("-inf")
        self._refreshing = threading.Lock()
        #: Fetches tried since the start, `load` included (tests and the log read it).
        self.fetches = 0

    def load(self) -> int:
        """The first fetch; raises JwksUnavailable. Returns the number of keys."""
        with self._refreshing:
            self._attempted_at = self._clock()
            self.fetches += 1
            self._keys = dict(self._fetch(self.url))
            self._fetched_at = self._attempted_at
        return len(self._keys)

    def key(self, kid: str) -> SigningKey | None:
        """The key named `kid`, refreshing the keys first when it is unknown (rate-limited)."""
        found = self._keys.get(kid)
        if found is None and self._refresh("unknown kid"):
            found = self._keys.get(kid)
        return found

    def held(self, kid: str) -> SigningKey | None:
        """The key named `kid` among those held now, never fetching."""
        return self._keys.get(kid)

    def refresh_if_stale(self) -> None:
        """Fetch again when the keys are older than max_age_seconds (the server's main loop)."""
        if self._clock() - self._fetched_at >= self.max_age_seconds:
            self._refresh("max age")

    def _refresh(self, reason: str) -> bool:
        """One fetch, unless one ran less than min_refresh_seconds ago or is running now
        (then nobody waits: the keys held answer). True when the keys were replaced."""
        if not self._refreshing.acquire(blocking=False):
            return False
        try:
            now = self._clock()
            if now - self._attempted_at < self.min_refresh_seconds:
                return False
            self._attempted_at = now
            self.fetches += 1
            try:
                keys = dict(self._fetch(self.url))
            except JwksUnavailable as exc:
                log_event(
                    log,
                    "jwks_refresh_failed",
                    level=logging.WARNING,
                    reason=reason,
                    error=str(exc),
                    kept=sorted(self._keys),
                )
                return False
            self._keys, self._fetched_at = keys, now
        finally:
            self._refreshing.release()
        log_event(log, "jwks_refreshed", reason=reason, kids=sorted(keys))
        return True
