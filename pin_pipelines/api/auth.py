"""Bearer tokens: the read API's only door to the dimension (devstats/actor.py).

A request's Actor comes from its `Authorization: Bearer <JWT>` header and nothing else (no
parameter or other header names a developer). The token must be signed RS256 or ES256 by a key
of the identity provider's JWKS, chosen by its `kid` and used with that key's algorithm only;
carry `iss` = PIN_API_ISSUER, `aud` holding PIN_API_AUDIENCE, `exp` in the future and `nbf` (when
present) in the past, CLOCK_LEEWAY_SECONDS either way for clocks that drift, and a `sub`. Any of
that failing is 401 (the caller must get a new token). A genuine token that does not grant the
read is 403: `roles` without `developer`, `permissions` without `dev-stats.view` (spec 003,
security), or no `developer_id` UUID to scope the reads by.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar
from uuid import UUID

import jwt
from jwt import exceptions as jwt_errors

from pin_pipelines.api.jwks import ALGORITHMS, JwksCache, SigningKey
from pin_pipelines.devstats import Actor, ActorDoor

ROLE = "developer"
PERMISSION = "dev-stats.view"
#: Seconds of clock difference tolerated on `exp`, `nbf` and `iat`.
CLOCK_LEEWAY_SECONDS = 30
#: A JWT of this API is well under 2 KB; a longer header is not worth decoding.
MAX_TOKEN_CHARS = 8192
#: Tokens whose signature, issuer and audience verified, remembered by their text: a client
#: sends the same token with every request until it expires, and the full check costs ~0.44 ms
#: of CPU (a hit ~0.02 ms; measured on the development machine), a sixth of what the API spends
#: on a labels request. A hit checks `exp`/`nbf` again and that the key is still the
#: provider's (a withdrawn key ends its tokens' hits at the next refresh).
VERIFIED_TOKENS = 4096

#: The 401 messages of PyJWT's failures, most specific first (subclasses before their bases).
_INVALID: tuple[tuple[type[jwt_errors.InvalidTokenError], str], ...] = (
    (jwt_errors.ExpiredSignatureError, "the token has expired"),
    (jwt_errors.ImmatureSignatureError, "the token is not valid yet"),
    (jwt_errors.InvalidIssuerError, "the token is from another issuer"),
    (jwt_errors.InvalidAudienceError, "the token is for another audience"),
    (jwt_errors.InvalidSignatureError, "the token's signature does not verify"),
    (jwt_errors.InvalidAlgorithmError, "the token's algorithm is not accepted"),
    (jwt_errors.DecodeError, "the token is malformed"),
)


class AuthError(Exception):
    """A request the API does not serve for who sent it; `status` is its HTTP answer."""

    status: ClassVar[int]


class Unauthorized(AuthError):
    """No token, or one that does not verify: 401 with `WWW-Authenticate: Bearer`."""

    status = 401


class Forbidden(AuthError):
    """A verified token that does not grant the read: 403."""

    status = 403


class TokenVerifier(ActorDoor):
    """Turns an Authorization header into an Actor, or raises Unauthorized / Forbidden."""

    def __init__(
        self,
        keys: JwksCache,
        *,
        issuer: str,
        audience: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` is the wall clock a remembered token's `exp` and `nbf` are checked against
        (PyJWT reads its own for the first check)."""
        self.keys = keys
        self._clock = clock
        self.issuer = issuer
        self.audience = audience
        #: token → (its claims, the key that verified it); oldest first, VERIFIED_TOKENS at most.
        self._verified: dict[str, tuple[dict[str, Any], SigningKey]] = {}

    def actor(self, authorization: str | None) -> Actor:
        claims = self.claims(_bearer_token(authorization))
        roles, permissions = claims.get("roles"), claims.get("permissions")
        if not isinstance(roles, list) or ROLE not in roles:
            raise Forbidden(f"the token does not carry the role {ROLE}")
        if not isinstance(permissions, list) or PERMISSION not in permissions:
            raise Forbidden(f"the token does not carry the permission {PERMISSION}")
        return self._admit(_developer_id(claims), str(claims["sub"]))

    def claims(self, token: str) -> dict[str, Any]:
        """The token's claims once its signature, issuer, audience and times verify."""
        hit = self._verified.get(token)
        if hit is not None and self.keys.held(hit[1].kid) is hit[1]:
            _check_times(hit[0], self._clock())
            return hit[0]
        claims, key = self._verify(token)
        self._verified[token] = (claims, key)
        while len(self._verified) > VERIFIED_TOKENS:
            self._verified.pop(next(iter(self._verified)), None)
        return claims

    def _verify(self, token: str) -> tuple[dict[str, Any], SigningKey]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt_errors.PyJWTError:
            raise Unauthorized("the token is malformed") from None
        algorithm, kid = header.get("alg"), header.get("kid")
        if algorithm not in ALGORITHMS:
            raise Unauthorized(f"the token's algorithm must be one of {', '.join(ALGORITHMS)}")
        if not isinstance(kid, str) or not kid:
            raise Unauthorized("the token names no signing key (kid)")
        key = self.keys.key(kid)
        if key is None:
            raise Unauthorized("the token's signing key is unknown")
        if key.algorithm != algorithm:
            raise Unauthorized(f"the token's key signs {key.algorithm}, not {algorithm}")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm],
                issuer=self.issuer,
                audience=self.audience,
                leeway=CLOCK_LEEWAY_SECONDS,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt_errors.MissingRequiredClaimError as exc:
            raise Unauthorized(f"the token has no {exc.claim} claim") from None
        except jwt_errors.InvalidTokenError as exc:
            raise Unauthorized(_invalid_message(exc)) from None
        return claims, key


def _check_times(claims: dict[str, Any], now: float) -> None:
    """`exp` and `nbf` of claims verified before, against the clock now (PyJWT's rules)."""
    if claims["exp"] <= now - CLOCK_LEEWAY_SECONDS:
        raise Unauthorized(_invalid_message(jwt_errors.ExpiredSignatureError()))
    if claims.get("nbf", now) > now + CLOCK_LEEWAY_SECONDS:
        raise Unauthorized(_invalid_message(jwt_errors.ImmatureSignatureError()))


def _bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized("a bearer token is required (Authorization: Bearer <JWT>)")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise Unauthorized("the Authorization header must be `Bearer <JWT>`")
    if len(token) > MAX_TOKEN_CHARS:
        raise Unauthorized("the token is malformed")
    return token


def _developer_id(claims: dict[str, Any]) -> UUID:
    raw = claims.get("developer_id")
    if isinstance(raw, str):
        try:
            return UUID(raw)
        except ValueError:
            pass
    raise Forbidden("the token names no developer (developer_id must be a UUID)")


def _invalid_message(exc: jwt_errors.InvalidTokenError) -> str:
    for kind, message in _INVALID:
        if isinstance(exc, kind):
            return message
    return "the token is invalid"
