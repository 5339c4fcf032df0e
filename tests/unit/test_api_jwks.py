"""The read API's key cache and token checks (api/jwks.py, api/auth.py) against a real identity
provider on 127.0.0.1 in this process (tests/support/idp.py): which keys it keeps, when it
fetches the JWKS again, and what a refresh that fails leaves. The clock is the test's, so "ten
seconds later" takes no time. No ClickHouse is involved: the verifier alone makes the Actor.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Mapping

import pytest

from pin_pipelines.api.auth import CLOCK_LEEWAY_SECONDS, Forbidden, TokenVerifier, Unauthorized
from pin_pipelines.api.jwks import (
    MAX_AGE_SECONDS,
    MIN_REFRESH_SECONDS,
    JwksCache,
    JwksUnavailable,
    SigningKey,
    fetch_jwks,
)
from pin_pipelines.stack.process import free_port
from tests.support.idp import AUDIENCE, ISSUER, IdentityProvider, ec_key, rsa_key

#: A key the provider does not know (generating RSA keys takes ~50 ms each).
STRANGER = rsa_key("stranger")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


@pytest.fixture
def clock() -> Clock:
    return Clock()


def verifier_for(idp: IdentityProvider, clock: Clock) -> TokenVerifier:
    verifier = TokenVerifier(JwksCache(idp.jwks_url, clock=clock), issuer=ISSUER, audience=AUDIENCE)
    verifier.keys.load()
    return verifier


def test_only_rs256_and_es256_signing_keys_with_a_kid_are_kept(idp: IdentityProvider) -> None:
    """Beside the provider's RSA and EC keys the JWKS holds keys the API must not verify with:
    a symmetric key, a 1,024-bit RSA key, an EC key on P-384, an encryption key, an RSA key
    declared PS256, one without a kid, one that is not an object."""
    small, p384 = rsa_key("small", bits=1024).jwk(), ec_key("p384").jwk()
    p384["crv"], p384["kid"] = "P-384", "p384"
    idp.extra_entries += [
        {"kty": "oct", "kid": "oct", "k": "c2VjcmV0"},
        small,
        p384,
        {**rsa_key("enc").jwk(), "use": "enc"},
        {**rsa_key("ps").jwk(), "alg": "PS256"},
        {key: value for key, value in rsa_key("x").jwk().items() if key != "kid"},
        "not a key",
    ]
    keys = fetch_jwks(idp.jwks_url)
    assert {kid: key.algorithm for kid, key in keys.items()} == {"rsa-1": "RS256", "ec-1": "ES256"}


def test_an_unknown_kid_refreshes_the_keys_at_most_once_per_interval(
    idp: IdentityProvider, clock: Clock
) -> None:
    """Rotation: a key added to the provider after the start is unknown; a token naming it
    fetches the JWKS once (after the interval since the last fetch) and verifies. Within the
    next interval no token, whatever kid it names, fetches again."""
    verifier = verifier_for(idp, clock)
    idp.add_key(rsa_key("rsa-2"))
    developer = uuid.uuid4()
    clock.now += MIN_REFRESH_SECONDS
    fetched = idp.fetches
    assert verifier.actor(f"Bearer {idp.token(developer, kid='rsa-2')}").developer_id == developer
    assert idp.fetches == fetched + 1
    for n in range(20):
        with pytest.raises(Unauthorized, match="signing key is unknown"):
            verifier.actor(f"Bearer {idp.token(developer, kid=f'k{n}', key=STRANGER)}")
    assert idp.fetches == fetched + 1
    clock.now += MIN_REFRESH_SECONDS
    with pytest.raises(Unauthorized):
        verifier.actor(f"Bearer {idp.token(developer, kid='k-late', key=STRANGER)}")
    assert idp.fetches == fetched + 2


def test_a_withdrawn_key_stops_verifying_after_the_max_age(
    idp: IdentityProvider, clock: Clock
) -> None:
    """The provider drops rsa-1: its tokens verify until the keys are older than the max age
    and the server's loop refreshes them; then they are 401. A refresh before that does
    nothing."""
    verifier = verifier_for(idp, clock)
    token = f"Bearer {idp.token(uuid.uuid4())}"
    idp.remove_key("rsa-1")
    clock.now += MAX_AGE_SECONDS - 1
    fetched = idp.fetches
    verifier.keys.refresh_if_stale()
    assert idp.fetches == fetched
    verifier.actor(token)
    clock.now += 1
    verifier.keys.refresh_if_stale()
    assert idp.fetches == fetched + 1
    with pytest.raises(Unauthorized, match="signing key is unknown"):
        verifier.actor(token)


def test_a_failed_refresh_keeps_the_keys(clock: Clock) -> None:
    """The provider goes away after the start: the stale refresh fails (logged), and tokens
    signed with the keys held still verify; the role check still applies."""
    with IdentityProvider() as idp:
        verifier = verifier_for(idp, clock)
        token = idp.token(uuid.uuid4())
        no_role = idp.token(uuid.uuid4(), roles=[])
    clock.now += MAX_AGE_SECONDS
    verifier.keys.refresh_if_stale()
    assert verifier.actor(f"Bearer {token}").door == "token"
    with pytest.raises(Forbidden):
        verifier.actor(f"Bearer {no_role}")


def test_a_refresh_in_flight_is_not_waited_for(idp: IdentityProvider, clock: Clock) -> None:
    """While one unknown kid's refresh waits for a slow provider, another unknown kid is 401 at
    once (no worker thread piles up behind the fetch), and a known kid verifies."""
    slow, gate, entered = threading.Event(), threading.Event(), threading.Event()

    def fetch(url: str) -> Mapping[str, SigningKey]:
        """The provider, slow once `slow` is set (after the start)."""
        if slow.is_set():
            entered.set()
            gate.wait(10)
        return fetch_jwks(url)

    keys = JwksCache(idp.jwks_url, clock=clock, fetch=fetch)
    keys.load()
    verifier = TokenVerifier(keys, issuer=ISSUER, audience=AUDIENCE)
    slow.set()
    clock.now += MIN_REFRESH_SECONDS
    outcomes: list[str] = []

    def first_stranger() -> None:
        try:
            verifier.actor(f"Bearer {idp.token(uuid.uuid4(), kid='k1', key=STRANGER)}")
        except Unauthorized as exc:
            outcomes.append(str(exc))

    first = threading.Thread(target=first_stranger)
    first.start()
    try:
        assert entered.wait(10)
        with pytest.raises(Unauthorized, match="unknown"):
            verifier.actor(f"Bearer {idp.token(uuid.uuid4(), kid='k2', key=STRANGER)}")
        verifier.actor(f"Bearer {idp.token(uuid.uuid4(), kid='ec-1')}")
    finally:
        gate.set()
        first.join(10)
    assert outcomes == ["the token's signing key is unknown"]


@pytest.mark.parametrize("path", ["/nothing-here", None])
def test_no_jwks_at_the_start_is_one_line(idp: IdentityProvider, path: str | None) -> None:
    """A JWKS URL that answers 404, and one where nothing listens: JwksUnavailable, one line
    naming the URL."""
    url = (
        idp.jwks_url.replace("/.well-known/jwks.json", path)
        if path
        else f"http://127.0.0.1:{free_port()}/jwks"
    )
    with pytest.raises(JwksUnavailable) as failure:
        JwksCache(url).load()
    assert url in str(failure.value) and "\n" not in str(failure.value)


def test_a_jwks_without_usable_keys_is_refused_at_the_start(idp: IdentityProvider) -> None:
    idp.remove_key("rsa-1")
    idp.remove_key("ec-1")
    idp.extra_entries.append({"kty": "oct", "kid": "oct", "k": "c2VjcmV0"})
    with pytest.raises(JwksUnavailable, match="no RS256 or ES256 signing key"):
        JwksCache(idp.jwks_url).load()


def test_a_remembered_token_still_expires(idp: IdentityProvider, clock: Clock) -> None:
    """The second request with a token skips the signature check (no JWKS involved), but its
    `exp` is checked against the clock each time: once past it (and the leeway), 401; a token
    not valid yet stays refused too."""
    wall = Clock()
    wall.now = time.time()
    verifier = TokenVerifier(
        JwksCache(idp.jwks_url, clock=clock), issuer=ISSUER, audience=AUDIENCE, clock=wall
    )
    verifier.keys.load()
    token = f"Bearer {idp.token(uuid.uuid4(), exp=int(wall.now) + 60)}"
    first = verifier.actor(token)
    assert verifier.actor(token) == first
    wall.now += 60 + CLOCK_LEEWAY_SECONDS + 1
    with pytest.raises(Unauthorized, match="expired"):
        verifier.actor(token)
    later = f"Bearer {idp.token(uuid.uuid4(), nbf=int(time.time()) + 3600)}"
    for _ in range(2):
        with pytest.raises(Unauthorized, match="not valid yet"):
            verifier.actor(later)
