"""The dev-stats read API (CONTRACT section 7) as an ASGI app: its routes, answers and errors.

Each read authenticates first (a request without a valid token learns nothing, not even whether
its parameters were right), then parses its parameters (`params.py`), then reads the dimension
for the token's Actor (`devstats/reads.py`). Its blocking work — the signature check, a JWKS
refresh on an unknown kid, the ClickHouse round trip — runs in one hop to the worker threads,
never on the event loop.

Every answer that is not a 200 is `{"error": "<one line>"}`: 400 for parameters (FastAPI's own
422 included, had it anything to validate), 401 with `WWW-Authenticate: Bearer`, 403, 404/405
for paths and methods the API does not have, 503 when the dimension cannot be read. Only
PUBLIC_PATHS answer without a token: elsewhere a path or method the API does not have is a 404
or 405 for a valid token only, and a 401 or 403 like any read otherwise (`/metrics` too: it is
served on a port of its own, server.py). Nothing a client sends leads to a 5xx; an unexpected
failure is a 500 with a fixed message, its cause in the request's log line only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar
from uuid import UUID

import msgspec
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException

from pin_pipelines import devstats
from pin_pipelines.api.auth import AuthError, TokenVerifier
from pin_pipelines.api.observe import ApiMetrics, RequestLog
from pin_pipelines.api.params import (
    IDS_PARAMETER,
    MAX_QUERY_BYTES,
    BadRequest,
    ids_parameter,
    only_known,
    project_id_parameter,
    project_parameter,
)
from pin_pipelines.api.pool import ClickHousePool
from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.devstats import Actor
from pin_pipelines.errors import PinError, first_line

log = logging.getLogger("pin_pipelines.api")

#: Threads of an app's blocking side (`_Reader`): a few more than the pool's clients, so that a
#: request refused on its token or parameters need not wait behind reads, and a read that finds
#: every client lent waits in the pool (503 after its CHECKOUT_SECONDS) rather than unseen here.
READ_THREADS = 16

T = TypeVar("T")


class ErrorBody(BaseModel):
    error: str


class LabelsBody(BaseModel):
    labels: dict[str, str]


class GroupBody(BaseModel):
    id: UUID
    projectId: UUID
    name: str
    sortOrder: int
    isArchived: bool


class GroupsBody(BaseModel):
    groups: list[GroupBody]


class HealthBody(BaseModel):
    status: str


class Unavailable(Exception):
    """The dimension cannot be read now: 503."""


#: The security scheme in the OpenAPI document; the header itself is read by TokenVerifier.
_BEARER = HTTPBearer(
    auto_error=False,
    bearerFormat="JWT",
    description="A JWT of the identity provider (RS256 or ES256): roles ∋ developer, "
    "permissions ∋ dev-stats.view, developer_id = the developer whose groups are read.",
)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]

_MESSAGES = {404: "no such path", 405: "method not allowed"}
#: The paths that answer without a token (CONTRACT section 7).
PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json"})
_UNAVAILABLE = "the dimension cannot be read right now"


def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description, **extra}


_READ_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error(
        "Bad parameters: not a UUID, no ids, more than 1,000 ids, a parameter given twice or "
        "one the request does not take, a query string over 48 KB."
    ),
    401: _error(
        "No token, or a malformed, expired, not yet valid or wrongly signed one.",
        headers={"WWW-Authenticate": {"schema": {"type": "string", "enum": ["Bearer"]}}},
    ),
    403: _error("A valid token without the role `developer` or the permission `dev-stats.view`."),
    503: _error("The dimension cannot be read right now."),
}


def create_app(
    pool: ClickHousePool, verifier: TokenVerifier, metrics: ApiMetrics | None = None
) -> FastAPI:
    """The API over `pool`'s dimension for the tokens `verifier` accepts; `metrics` (its own
    registry by default) counts the requests (served apart from the app: server.py)."""
    metrics = metrics or ApiMetrics()
    reader = _Reader(pool, verifier)
    app = FastAPI(
        title="pin-pipelines dev-stats read API",
        version="1",
        description="Layout-group labels and groups of dim_layout_group for the token's "
        'developer (spec 003). Every error is `{"error": "<one line>"}`.',
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.add_middleware(RequestLog, metrics=metrics)
    _answer_errors_in_one_line(app, reader)

    @app.get(
        "/v1/layout-groups/labels",
        response_model=LabelsBody,
        responses=_READ_ERRORS,
        openapi_extra={"parameters": [IDS_PARAMETER, project_id_parameter(required=False)]},
        operation_id="layoutGroupLabels",
        summary="Labels of layout groups: the Name, or the id when the group is not the "
        "developer's (or, with projectId, not that project's) or has no row yet.",
    )
    async def layout_group_labels(request: Request, _: Bearer) -> Any:
        return await reader.run(reader.labels, request)

    @app.get(
        "/v1/layout-groups",
        response_model=GroupsBody,
        responses=_READ_ERRORS,
        openapi_extra={"parameters": [project_id_parameter(required=True)]},
        operation_id="layoutGroups",
        summary="The developer's groups of a project in display order (SortOrder, then id), "
        "archived ones included.",
    )
    async def layout_groups(request: Request, _: Bearer) -> Any:
        return await reader.run(reader.groups, request)

    @app.get(
        "/healthz",
        response_model=HealthBody,
        responses={503: _error("The dimension cannot be read.")},
        operation_id="health",
        summary="200 once the service can read the dimension (no token needed).",
    )
    async def healthz() -> Any:
        await reader.run(reader.check)
        return HealthBody(status="ok")

    return app


class _Reader:
    """The blocking side of the routes: verify, parse, read."""

    def __init__(self, pool: ClickHousePool, verifier: TokenVerifier) -> None:
        self.pool = pool
        self.verifier = verifier
        # The hop to these threads is a plain executor, not Starlette's run_in_threadpool, whose
        # anyio machinery (capacity limiter, cancel scope, task bookkeeping) cost ~0.2 ms of the
        # event loop's CPU per request (py-spy under bench_api's load): a tenth of the API's CPU
        # for a labels read, and the event loop is the API's queue.
        self._threads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="pin-api-read")

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the reader's threads, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, call, *args)

    def labels(self, request: Request) -> Response:
        actor = self._actor(request)
        query = _query(request, ("ids", "projectId"))
        ids = ids_parameter(query.getlist("ids"))
        project_id = project_parameter(query.getlist("projectId"), required=False)
        request.state.ids = len(ids)
        with self._dimension() as ch:
            found = devstats.labels(ch, actor, ids, project_id)
        # Encoded here (msgspec: a tenth of json's time for 1,000 labels): the body is a plain
        # dict of strings, LabelsBody only documents it.
        return Response(_JSON.encode({"labels": found}), media_type="application/json")

    def groups(self, request: Request) -> GroupsBody:
        actor = self._actor(request)
        query = _query(request, ("projectId",))
        project_id = project_parameter(query.getlist("projectId"), required=True)
        with self._dimension() as ch:
            found = devstats.groups(ch, actor, project_id)
        return GroupsBody(
            groups=[
                GroupBody(
                    id=group.layout_group_id,
                    projectId=group.project_id,
                    name=group.name,
                    sortOrder=group.sort_order,
                    isArchived=group.is_archived,
                )
                for group in found
            ]
        )

    def check(self) -> None:
        with self._dimension() as ch:
            devstats.readable(ch)

    def authenticate(self, request: Request) -> None:
        """The token checked for an answer that reads nothing (AuthError: 401 or 403)."""
        self._actor(request)

    def _actor(self, request: Request) -> Actor:
        actor = self.verifier.actor(request.headers.get("authorization"))
        request.state.actor = actor
        return actor

    @contextmanager
    def _dimension(self) -> Iterator[ClickHouse]:
        try:
            with self.pool.client() as ch:
                yield ch
        except PinError as exc:  # ClickHouse unreachable, busy, or refusing the read
            raise Unavailable(first_line(exc)) from None


_JSON = msgspec.json.Encoder()


def _query(request: Request, known: tuple[str, ...]) -> QueryParams:
    if len(request.scope["query_string"]) > MAX_QUERY_BYTES:
        raise BadRequest(f"the query string is longer than {MAX_QUERY_BYTES:,} bytes")
    query = request.query_params
    only_known(query.keys(), known)
    return query


def _answer_errors_in_one_line(app: FastAPI, reader: _Reader) -> None:
    def answer(
        request: Request,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        logged: str | None = None,
    ) -> JSONResponse:
        """The client gets `message`; the request's log line `logged` (the cause) or it."""
        request.state.error = logged or message
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    async def on_auth(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AuthError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return answer(request, exc.status, str(exc), headers)

    async def on_bad_request(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, 400, str(exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = exc.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        what = first_line(Exception(str(first.get("msg", "")))) if first else "bad request"
        return answer(request, 400, f"{where}: {what}" if where else what)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code in _MESSAGES and request.scope["path"] not in PUBLIC_PATHS:
            try:  # no path or method is disclosed to a request without a valid token
                await reader.run(reader.authenticate, request)
            except AuthError as refused:
                return await on_auth(request, refused)
        message = _MESSAGES.get(exc.status_code) or first_line(Exception(str(exc.detail)))
        return answer(request, exc.status_code, message, dict(exc.headers or {}) or None)

    async def on_unavailable(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, 503, _UNAVAILABLE, logged=f"{_UNAVAILABLE}: {exc}")

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        """The last resort: a fixed message (RequestLog logs the cause; Starlette re-raises the
        exception afterwards, to the server's log)."""
        return answer(request, 500, "internal error")

    app.add_exception_handler(AuthError, on_auth)
    app.add_exception_handler(BadRequest, on_bad_request)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Unavailable, on_unavailable)
    app.add_exception_handler(Exception, on_unexpected)
