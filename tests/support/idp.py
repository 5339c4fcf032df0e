"""A tiny identity provider for the read API's tests: a real HTTP server on 127.0.0.1 (a free
port, in a thread of the test process) serving a JWKS of RSA and EC keys made with
`cryptography`, and tokens minted with PyJWT by those keys.

The provider's keys can be rotated (`add_key`, `remove_key`) and its JWKS fetches are counted
(`fetches`), so the tests see the API's cache refresh on an unknown kid, and only as often as
it may.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "https://idp.test.pin/"
AUDIENCE = "pin-dev-stats"
JWKS_PATH = "/.well-known/jwks.json"

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@dataclass
class Key:
    kid: str
    algorithm: str
    private: PrivateKey

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        if isinstance(public, rsa.RSAPublicKey):
            data = RSAAlgorithm.to_jwk(public, as_dict=True)
        else:
            data = ECAlgorithm.to_jwk(public, as_dict=True)
        return {**data, "kid": self.kid, "use": "sig", "alg": self.algorithm}


def rsa_key(kid: str, bits: int = 2048) -> Key:
    return Key(kid, "RS256", rsa.generate_private_key(public_exponent=65537, key_size=bits))


def ec_key(kid: str) -> Key:
    return Key(kid, "ES256", ec.generate_private_key(ec.SECP256R1()))


@dataclass
class IdentityProvider:
    """Serves `keys` as its JWKS at `jwks_url` while started (use as a context manager)."""

    keys: list[Key] = field(default_factory=lambda: [rsa_key("rsa-1"), ec_key("ec-1")])
    fetches: int = 0
    #: Extra JWK entries served as they are (unusable keys the API must skip).
    extra_entries: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != JWKS_PATH:
                    self.send_error(404)
                    return
                with provider._lock:
                    provider.fetches += 1
                    body = json.dumps(
                        {"keys": [k.jwk() for k in provider.keys] + provider.extra_entries}
                    ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def jwks_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{JWKS_PATH}"

    def __enter__(self) -> IdentityProvider:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def add_key(self, key: Key) -> None:
        with self._lock:
            self.keys.append(key)

    def remove_key(self, kid: str) -> None:
        with self._lock:
            self.keys = [k for k in self.keys if k.kid != kid]

    def key(self, kid: str) -> Key:
        return next(k for k in self.keys if k.kid == kid)

    def claims(
        self, developer: uuid.UUID | str | None, *, drop: tuple[str, ...] = (), **claims: Any
    ) -> dict[str, Any]:
        """The claims of a token for `developer` (its `developer_id`) with the role and
        permission the API needs, valid for 5 minutes; `claims` override or add claims (a
        `developer_id` of any type too), `drop` removes some."""
        now = int(time.time())
        payload: dict[str, Any] = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": f"user-{uuid.uuid4().hex[:8]}",
            "developer_id": None if developer is None else str(developer),
            "roles": ["developer"],
            "permissions": ["dev-stats.view"],
            "iat": now,
            "nbf": now - 5,
            "exp": now + 300,
            **claims,
        }
        for name in drop:
            payload.pop(name, None)
        return payload

    def token(
        self,
        developer: uuid.UUID | str | None,
        *,
        kid: str = "rsa-1",
        key: Key | None = None,
        drop: tuple[str, ...] = (),
        headers: dict[str, Any] | None = None,
        **claims: Any,
    ) -> str:
        """A token signed by the provider's key `kid` (or by `key`, under the header `kid`)."""
        signer = key or self.key(kid)
        return jwt.encode(
            self.claims(developer, drop=drop, **claims),
            signer.private,
            algorithm=signer.algorithm,
            headers={"kid": kid, **(headers or {})},
        )


def handmade_token(
    header: dict[str, Any], payload: dict[str, Any], sign: Callable[[bytes], bytes] | None
) -> str:
    """A JWT put together by hand, for what PyJWT refuses to make: `alg: none` (no signature),
    HS256 keyed with a public key."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"
    signature = sign(signing_input.encode()) if sign else b""
    return f"{signing_input}.{_b64(signature)}"


def public_pem(key: Key) -> bytes:
    return key.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def hmac_sha256(secret: bytes) -> Callable[[bytes], bytes]:
    return lambda data: hmac.new(secret, data, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def api_env(provider: IdentityProvider) -> dict[str, str]:
    """The PIN_API_* settings that make the API trust `provider`."""
    return {
        "PIN_API_JWKS_URL": provider.jwks_url,
        "PIN_API_ISSUER": ISSUER,
        "PIN_API_AUDIENCE": AUDIENCE,
    }
