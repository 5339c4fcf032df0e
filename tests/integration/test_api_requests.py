"""The read API's answers and its refusals (CONTRACT section 7), request by request.

The app is the real one (`api.app.create_app`) over the Debian ClickHouse server's dimension,
served in this process through FastAPI's TestClient; tokens are minted by a real identity
provider on 127.0.0.1 (tests/support/idp.py) whose JWKS the app fetches over HTTP. The same
paths through a real `pin api serve` process, on both engines and while a loader runs:
test_api_serve.py. Rows go in through the loader's own write; developers are fresh UUIDs, so the
shared server's table needs no cleaning.

Every refusal is checked for its status, `{"error": "<one line>"}` as JSON and no trace of a
traceback, and 401s for `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from httpx import Response
from starlette.exceptions import StarletteDeprecationWarning

from pin_pipelines.api.app import create_app
from pin_pipelines.api.auth import TokenVerifier
from pin_pipelines.api.jwks import JwksCache
from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.api.pool import ClickHousePool
from pin_pipelines.clickhouse import ClickHouse, open_clickhouse
from pin_pipelines.devstats.dim import insert_events
from pin_pipelines.devstats.events import parse_event
from tests.support.api import api_client
from tests.support.devstats import Group
from tests.support.idp import (
    AUDIENCE,
    ISSUER,
    IdentityProvider,
    ec_key,
    handmade_token,
    hmac_sha256,
    public_pem,
    rsa_key,
)

with warnings.catch_warnings():  # starlette 1.x would rather have the httpx2 fork; httpx works
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

LABELS = "/v1/layout-groups/labels"
#: A key the provider does not know (generating RSA keys takes ~50 ms each).
STRANGER = rsa_key("stranger")
GROUPS = "/v1/layout-groups"


def store(ch: ClickHouse, group: Group, version: int = 1, **overrides: Any) -> None:
    insert_events(ch, [parse_event(json.dumps(group.event(version, **overrides)).encode())])


@dataclass
class Catalogue:
    """Two developers' groups: `mine` (project P: three groups, one archived; project Q: one)
    and another developer's group in project P and in a project of their own."""

    developer: uuid.UUID
    project_p: uuid.UUID
    project_q: uuid.UUID
    mine_p: list[Group]
    mine_q: Group
    theirs_p: Group
    theirs: Group


@pytest.fixture(scope="module")
def catalogue(clickhouse_server_url: str) -> Catalogue:
    developer, p, q = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    mine_p = [Group(developer, p) for _ in range(3)]
    cat = Catalogue(
        developer, p, q, mine_p, Group(developer, q), Group(project_id=p), Group(uuid.uuid4())
    )
    with open_clickhouse(clickhouse_server_url) as ch:
        store(ch, mine_p[0], SortOrder=20, Name="Люкс с видом на море")
        store(ch, mine_p[1], SortOrder=10, Name="Студии")
        store(ch, mine_p[2], SortOrder=10, Name="Архив", IsArchived=True)
        store(ch, cat.mine_q, Name="Q")
        store(ch, cat.theirs_p, Name="их")
        store(ch, cat.theirs, Name="чужое")
    return cat


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


@pytest.fixture(scope="module")
def api_metrics() -> ApiMetrics:
    """The app's counters (`pin api serve` serves them on a port of its own: test_api_serve.py)."""
    return ApiMetrics()


@pytest.fixture(scope="module")
def client(
    idp: IdentityProvider, clickhouse_server_url: str, api_metrics: ApiMetrics
) -> Iterator[TestClient]:
    with api_client(clickhouse_server_url, idp, api_metrics) as test_client:
        yield test_client


def get(client: TestClient, path: str, token: str | None = None, **kwargs: Any) -> Response:
    headers = dict(kwargs.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return client.get(path, headers=headers, **kwargs)


def refused(response: Response, status: int) -> str:
    """The one-line error of a refusal with `status`; 401s carry `WWW-Authenticate: Bearer`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert body["error"] and "\n" not in body["error"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    return str(body["error"])


def ids(*groups: Group | uuid.UUID) -> str:
    return ",".join(str(g.id if isinstance(g, Group) else g) for g in groups)


# --- what a developer reads -------------------------------------------------------------------


def test_labels_are_names_or_the_id(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue
) -> None:
    """Tried: the developer's groups (an archived one too), a missing id, in one request; then
    the same with projectId P (the group of Q degrades to its id); an EC-signed token too."""
    c = catalogue
    missing = uuid.uuid4()
    asked = [*c.mine_p, c.mine_q, missing]
    expected = {
        str(c.mine_p[0].id): "Люкс с видом на море",
        str(c.mine_p[1].id): "Студии",
        str(c.mine_p[2].id): "Архив",
        str(c.mine_q.id): "Q",
        str(missing): str(missing),
    }
    for kid in ("rsa-1", "ec-1"):
        answer = get(client, LABELS, idp.token(c.developer, kid=kid), params={"ids": ids(*asked)})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"labels": expected}
    in_p = get(
        client,
        LABELS,
        idp.token(c.developer),
        params={"ids": ids(*asked), "projectId": str(c.project_p)},
    )
    assert in_p.json() == {"labels": {**expected, str(c.mine_q.id): str(c.mine_q.id)}}


def test_groups_of_a_project_in_display_order(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue
) -> None:
    """SortOrder, then id; the archived group included; the other project's group and the other
    developer's group of the same project left out."""
    c = catalogue
    answer = get(client, GROUPS, idp.token(c.developer), params={"projectId": str(c.project_p)})
    assert answer.status_code == 200, answer.text
    tens = sorted([c.mine_p[1], c.mine_p[2]], key=lambda g: str(g.id))
    assert answer.json() == {
        "groups": [
            {
                "id": str(g.id),
                "projectId": str(c.project_p),
                "name": name,
                "sortOrder": order,
                "isArchived": archived,
            }
            for g, name, order, archived in [
                *[
                    (g, "Студии" if g is c.mine_p[1] else "Архив", 10, g is c.mine_p[2])
                    for g in tens
                ],
                (c.mine_p[0], "Люкс с видом на море", 20, False),
            ]
        ]
    }


def test_another_developers_groups_look_missing(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue
) -> None:
    """No oracle: the other developer's groups (one in the developer's own project P) are
    labelled with their id exactly like an id that exists nowhere, with or without projectId;
    their project's groups list is empty, as is a project that does not exist."""
    c = catalogue
    token = idp.token(c.developer)
    missing = uuid.uuid4()
    asked = ids(c.theirs_p, c.theirs, missing)
    for project in (None, c.project_p, c.theirs.project_id):
        query = {"ids": asked} | ({"projectId": str(project)} if project else {})
        assert get(client, LABELS, token, params=query).json() == {
            "labels": {str(i): str(i) for i in (c.theirs_p.id, c.theirs.id, missing)}
        }
    for project in (c.theirs.project_id, uuid.uuid4()):
        answer = get(client, GROUPS, token, params={"projectId": str(project)})
        assert answer.status_code == 200 and answer.json() == {"groups": []}


def test_no_parameter_or_header_names_a_developer(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue
) -> None:
    """The other developer's id as a `developerId`, `developer_id` or `tenantId` parameter: 400
    naming it (a route takes its own parameters only); as headers: ignored, the token's
    developer is read."""
    c = catalogue
    other = str(c.theirs.developer_id)
    token = idp.token(c.developer)
    for name in ("developerId", "developer_id", "tenantId"):
        query = {"ids": ids(c.theirs, c.mine_q), name: other}
        assert f"unknown query parameter '{name}'" in refused(
            get(client, LABELS, token, params=query), 400
        )
        query = {"projectId": str(c.theirs.project_id), name: other}
        refused(get(client, GROUPS, token, params=query), 400)
    answer = get(
        client,
        LABELS,
        token,
        params={"ids": ids(c.theirs, c.mine_q)},
        headers={"X-Developer-Id": other, "Developer-Id": other, "X-Tenant-Id": other},
    )
    assert answer.json() == {"labels": {str(c.theirs.id): str(c.theirs.id), str(c.mine_q.id): "Q"}}


def test_duplicate_ids_are_answered_once_and_1000_ids_are_fine(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue
) -> None:
    c = catalogue
    token = idp.token(c.developer)
    twice = get(client, LABELS, token, params={"ids": ids(c.mine_q, c.mine_q, c.mine_q)})
    assert twice.json() == {"labels": {str(c.mine_q.id): "Q"}}
    many = [c.mine_q.id, *(uuid.uuid4() for _ in range(999))]
    answer = get(client, LABELS, token, params={"ids": ids(*many)})
    assert answer.status_code == 200
    labels = answer.json()["labels"]
    assert len(labels) == 1000 and labels[str(c.mine_q.id)] == "Q"
    upper = get(client, LABELS, token, params={"ids": str(c.mine_q.id).upper()})
    assert upper.json() == {"labels": {str(c.mine_q.id): "Q"}}


# --- tokens -----------------------------------------------------------------------------------


def test_no_token_or_a_malformed_header_is_401(client: TestClient, idp: IdentityProvider) -> None:
    token = idp.token(uuid.uuid4())
    params = {"ids": str(uuid.uuid4())}
    for path, query in ((LABELS, params), (GROUPS, {"projectId": str(uuid.uuid4())})):
        assert "bearer token is required" in refused(client.get(path, params=query), 401)
    header: str | bytes
    for header in (
        "",
        "Bearer",
        "Bearer ",
        f"Basic {token}",
        f"Bearer {token} extra",
        "Bearer not-a-jwt",
        "Bearer a.b.c",
        f"Bearer {token[:-10]}",
        f"Bearer {'x' * 9000}",
        "Bearer ☃.☃.☃".encode(),
    ):
        refused(client.get(LABELS, params=params, headers={"Authorization": header}), 401)
    # no parameter check before the token: a bad query without a token is still 401
    refused(client.get(LABELS, params={"ids": "nope"}), 401)


@pytest.mark.parametrize(
    ("claims", "drop", "message"),
    [
        pytest.param({"exp": 1_000_000}, (), "expired", id="expired"),
        pytest.param({"nbf": 4_000_000_000}, (), "not valid yet", id="not-yet-valid"),
        pytest.param({"iat": 4_000_000_000}, (), "", id="issued-in-the-future"),
        pytest.param({"iss": "https://evil.example/"}, (), "another issuer", id="wrong-issuer"),
        pytest.param({"aud": "someone-else"}, (), "another audience", id="wrong-audience"),
        pytest.param({}, ("exp",), "no exp claim", id="no-exp"),
        pytest.param({}, ("iss",), "no iss claim", id="no-iss"),
        pytest.param({}, ("aud",), "no aud claim", id="no-aud"),
        pytest.param({}, ("sub",), "no sub claim", id="no-sub"),
    ],
)
def test_a_token_that_does_not_verify_is_401(
    client: TestClient,
    idp: IdentityProvider,
    claims: dict[str, Any],
    drop: tuple[str, ...],
    message: str,
) -> None:
    token = idp.token(uuid.uuid4(), drop=drop, **claims)
    assert message in refused(get(client, LABELS, token, params={"ids": str(uuid.uuid4())}), 401)


def test_forged_signatures_and_algorithms_are_401(
    client: TestClient, idp: IdentityProvider
) -> None:
    """An unknown kid; a known kid signed by another key (RSA and EC); `alg: none`; HS256 keyed
    with the provider's own public key (algorithm confusion), with and without a kid; an RSA
    kid claimed as ES256; RS512 by the right key."""
    developer = uuid.uuid4()
    claims = idp.claims(developer)
    pem = public_pem(idp.key("rsa-1"))
    forged = {
        "unknown-kid": idp.token(developer, kid="nobody", key=rsa_key("nobody")),
        "rsa-other-key": idp.token(developer, kid="rsa-1", key=rsa_key("rsa-1")),
        "ec-other-key": idp.token(developer, kid="ec-1", key=ec_key("ec-1")),
        "alg-none": handmade_token({"alg": "none", "kid": "rsa-1"}, claims, None),
        "alg-none-no-kid": handmade_token({"alg": "none", "typ": "JWT"}, claims, None),
        "hs256-public-key": handmade_token(
            {"alg": "HS256", "kid": "rsa-1"}, claims, hmac_sha256(pem)
        ),
        "hs256-no-kid": handmade_token({"alg": "HS256"}, claims, hmac_sha256(pem)),
        "es256-header-rsa-key": handmade_token(
            {"alg": "ES256", "kid": "rsa-1"}, claims, hmac_sha256(pem)
        ),
        "rs512": idp.token(developer, headers={"alg": "RS512"}),
    }
    for name, token in forged.items():
        message = refused(get(client, LABELS, token, params={"ids": str(uuid.uuid4())}), 401)
        assert message, name


def test_random_kids_refresh_the_jwks_at_most_once(
    client: TestClient, idp: IdentityProvider
) -> None:
    """50 tokens with made-up kids in a row: all 401, and the provider sees at most one fetch
    (the cache refreshes on an unknown kid no more than once per 10 s)."""
    before = idp.fetches
    for n in range(50):
        token = idp.token(uuid.uuid4(), kid=f"random-{n}", key=STRANGER)
        refused(get(client, LABELS, token, params={"ids": str(uuid.uuid4())}), 401)
    assert idp.fetches - before <= 1


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        pytest.param({"roles": []}, "role developer", id="no-role"),
        pytest.param({"roles": ["admin"]}, "role developer", id="other-role"),
        pytest.param({"roles": "developer"}, "role developer", id="role-not-a-list"),
        pytest.param({"permissions": []}, "dev-stats.view", id="no-permission"),
        pytest.param({"permissions": ["dev-stats.edit"]}, "dev-stats.view", id="other-permission"),
        pytest.param({"permissions": None}, "dev-stats.view", id="permissions-null"),
        pytest.param({"developer_id": None}, "developer_id", id="no-developer"),
        pytest.param({"developer_id": "not-a-uuid"}, "developer_id", id="developer-not-a-uuid"),
        pytest.param({"developer_id": 42}, "developer_id", id="developer-a-number"),
    ],
)
def test_a_valid_token_without_the_grant_is_403(
    client: TestClient, idp: IdentityProvider, claims: dict[str, Any], message: str
) -> None:
    token = idp.token(uuid.uuid4(), **claims)
    for path, query in (
        (LABELS, {"ids": str(uuid.uuid4())}),
        (GROUPS, {"projectId": str(uuid.uuid4())}),
    ):
        assert message in refused(get(client, path, token, params=query), 403)


# --- parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "query", "message"),
    [
        pytest.param(LABELS, "", "ids is required", id="no-ids"),
        pytest.param(LABELS, "ids=", "ids is required", id="empty-ids"),
        pytest.param(LABELS, "ids=nope", "entry 1 is not a UUID", id="not-a-uuid"),
        pytest.param(LABELS, f"ids={uuid.uuid4()},", "entry 2", id="trailing-comma"),
        pytest.param(LABELS, f"ids={uuid.uuid4()},,{uuid.uuid4()}", "entry 2", id="empty-entry"),
        pytest.param(LABELS, f"ids=%20{uuid.uuid4()}", "entry 1", id="space"),
        pytest.param(LABELS, f"ids={{{uuid.uuid4()}}}", "entry 1", id="braces"),
        pytest.param(LABELS, f"ids={uuid.uuid4().hex}", "entry 1", id="no-dashes"),
        pytest.param(LABELS, f"ids=urn:uuid:{uuid.uuid4()}", "entry 1", id="urn"),
        pytest.param(
            LABELS,
            "ids=" + ",".join(str(uuid.uuid4()) for _ in range(1001)),
            "1,001 ids",
            id="1001-ids",
        ),
        pytest.param(
            LABELS, f"ids={uuid.uuid4()}&ids={uuid.uuid4()}", "given 2 times", id="ids-twice"
        ),
        pytest.param(
            LABELS, f"ids={uuid.uuid4()}&projectId=p", "projectId is not a UUID", id="bad-project"
        ),
        pytest.param(GROUPS, "", "projectId is required", id="groups-no-project"),
        pytest.param(
            GROUPS, f"ids={uuid.uuid4()}", "unknown query parameter 'ids'", id="groups-ids"
        ),
        pytest.param(GROUPS, "projectId=", "projectId is not a UUID", id="groups-empty-project"),
        pytest.param(
            GROUPS,
            f"projectId={uuid.uuid4()}&projectId={uuid.uuid4()}",
            "given 2 times",
            id="project-twice",
        ),
        pytest.param(
            LABELS, "ids=" + "a" * 60_000, "longer than 49,152 bytes", id="huge-query-string"
        ),
    ],
)
def test_bad_parameters_are_400(
    client: TestClient, idp: IdentityProvider, path: str, query: str, message: str
) -> None:
    answer = get(client, f"{path}?{query}", idp.token(uuid.uuid4()))
    assert message in refused(answer, 400)


SQL = [
    "' OR 1=1 --",
    "'; DROP TABLE pin_dev_stats.dim_layout_group; --",
    "00000000-0000-0000-0000-000000000000') OR ('1'='1",
    "1 UNION SELECT name FROM system.tables",
    "\\'; SELECT sleep(3); --",
]


@pytest.mark.parametrize("sql", SQL)
def test_sql_in_every_parameter_is_refused_and_harmless(
    client: TestClient, idp: IdentityProvider, catalogue: Catalogue, sql: str
) -> None:
    """SQL as ids (alone and after a valid id), as projectId on both routes, as a parameter's
    name, in a header, as the token and inside the token's developer_id: 400 / 401 / 403 / an
    ignored header, never a 5xx; the dimension still answers afterwards."""
    c = catalogue
    token = idp.token(c.developer)
    for query in (
        {"ids": sql},
        {"ids": f"{c.mine_q.id},{sql}"},
        {"ids": str(c.mine_q.id), "projectId": sql},
    ):
        refused(get(client, LABELS, token, params=query), 400)
    refused(get(client, GROUPS, token, params={"projectId": sql}), 400)
    refused(get(client, LABELS, sql, params={"ids": str(c.mine_q.id)}), 401)
    refused(get(client, LABELS, idp.token(sql), params={"ids": str(c.mine_q.id)}), 403)
    refused(get(client, LABELS, token, params={"ids": str(c.mine_q.id), sql: "x"}), 400)
    ignored = get(client, LABELS, token, params={"ids": str(c.mine_q.id)}, headers={"X-Q": sql})
    assert ignored.json() == {"labels": {str(c.mine_q.id): "Q"}}


# --- the rest of the surface ------------------------------------------------------------------


def test_unknown_paths_and_methods_answer_in_one_line(
    client: TestClient, idp: IdentityProvider
) -> None:
    """404 and 405 for a valid token only: without one, the paths the API does not have —
    /metrics among them, served on a port of its own — are a 401 like any read (403 without the
    permission); /healthz and /openapi.json are the only paths open to all."""
    token = idp.token(uuid.uuid4())
    refused(get(client, "/v1/nope", token), 404)
    refused(get(client, f"{GROUPS}/", token), 404)
    refused(get(client, "/metrics", token), 404)
    refused(client.post(LABELS, headers={"Authorization": f"Bearer {token}"}), 405)
    for path in ("/metrics", "/v1/nope", f"{GROUPS}/", "/healthz/", "/"):
        assert "bearer token is required" in refused(get(client, path), 401)
    refused(get(client, "/metrics", "not-a-jwt"), 401)
    refused(get(client, "/metrics", idp.token(uuid.uuid4(), permissions=[])), 403)
    refused(client.delete(GROUPS), 401)
    refused(client.post("/healthz"), 405)
    refused(client.post("/openapi.json"), 405)


def test_healthz_and_openapi_need_no_token(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    document = client.get("/openapi.json").json()
    assert {LABELS, GROUPS, "/healthz"} <= set(document["paths"])
    labels = document["paths"][LABELS]["get"]
    assert labels["security"] == [{"HTTPBearer": []}]
    assert {p["name"]: p["required"] for p in labels["parameters"]} == {
        "ids": True,
        "projectId": False,
    }
    assert {"200", "400", "401", "403", "503"} <= set(labels["responses"])
    assert "422" not in labels["responses"]


def test_requests_are_counted_and_logged_with_their_actor(
    client: TestClient,
    api_metrics: ApiMetrics,
    idp: IdentityProvider,
    catalogue: Catalogue,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app's ApiMetrics (the metrics listener's text: test_api_serve.py) counts every answer
    by status and times it by route; each request's JSON log line names the token's developer
    and subject, or the error."""
    token = idp.token(catalogue.developer, sub="user-42")
    with caplog.at_level(logging.INFO, logger="pin_pipelines.api"):
        get(client, LABELS, token, params={"ids": str(catalogue.mine_q.id)})
        get(client, LABELS, params={"ids": str(catalogue.mine_q.id)})
    body, content_type = api_metrics.exposition()
    assert content_type.startswith("text/plain")
    samples = body.decode().splitlines()
    for status in ("200", "401"):
        assert any(
            s.startswith(f'devstats_api_requests_total{{status="{status}"}}') for s in samples
        )
    assert any(
        s.startswith('devstats_api_request_duration_seconds_bucket{le="0.05",route="labels"}')
        for s in samples
    )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pin_pipelines.api"]
    requests = [line for line in lines if line["event"] == "api_request"]
    assert requests[-2] | {"ms": 0, "ts": ""} == {
        "ts": "",
        "event": "api_request",
        "method": "GET",
        "route": "labels",
        "path": LABELS,
        "status": 200,
        "ms": 0,
        "developer_id": str(catalogue.developer),
        "subject": "user-42",
        "ids": 1,
        "error": None,
    }
    assert requests[-1]["status"] == 401 and requests[-1]["developer_id"] is None
    assert "bearer token is required" in requests[-1]["error"]


def test_fastapis_own_validation_errors_are_400_in_one_line(client: TestClient) -> None:
    """The API validates its parameters itself, so no request reaches FastAPI's 422; its handler
    is replaced all the same (a future parameter declared the FastAPI way): a multi-line
    pydantic message becomes a one-line 400."""
    handler = client.app.exception_handlers[RequestValidationError]  # type: ignore[attr-defined]
    problem = {"loc": ("query", "limit"), "msg": "Input should be\na valid integer", "type": "x"}
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": []})
    answer = asyncio.run(handler(request, RequestValidationError([problem])))
    assert answer.status_code == 400
    assert json.loads(answer.body) == {"error": "query.limit: Input should be"}


class _BrokenPool(ClickHousePool):
    """A pool whose lending fails with something unexpected (a bug, not ClickHouse)."""

    def __init__(self) -> None:
        self.size = 1

    @contextmanager
    def client(self, timeout: float = 0) -> Iterator[ClickHouse]:
        raise ZeroDivisionError("a bug")
        yield  # pragma: no cover


def test_an_unexpected_failure_is_a_500_without_its_traceback(
    idp: IdentityProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug behind a valid request: 500 `{"error": "internal error"}`, nothing of the
    exception in the body; the request's log line carries its type and message."""
    verifier = TokenVerifier(JwksCache(idp.jwks_url), issuer=ISSUER, audience=AUDIENCE)
    verifier.keys.load()
    with (
        TestClient(create_app(_BrokenPool(), verifier), raise_server_exceptions=False) as broken,
        caplog.at_level(logging.INFO, logger="pin_pipelines.api"),
    ):
        answer = get(broken, LABELS, idp.token(uuid.uuid4()), params={"ids": str(uuid.uuid4())})
    assert refused(answer, 500) == "internal error"
    assert "a bug" not in answer.text and "ZeroDivision" not in answer.text
    [line] = [json.loads(r.getMessage()) for r in caplog.records if "api_request" in r.getMessage()]
    assert line["status"] == 500 and line["error"] == "internal error: ZeroDivisionError: a bug"
