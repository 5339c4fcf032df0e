"""The dev-stats read API (CONTRACT section 7): `pin api serve`.

An HTTP service over the dimension dim_layout_group for developers: labels of layout groups and a
project's groups, for the developer a bearer token proves (spec 003, security).

- `auth.py`   the token → `Actor` door (devstats/actor.py): JWKS keys, claims, role, permission
- `jwks.py`   the identity provider's keys, cached and refreshed (rate-limited)
- `params.py` the query parameters, parsed and described (OpenAPI)
- `app.py`    the routes, answers and one-line errors (FastAPI)
- `observe.py` a JSON log line and metrics per request (served on PIN_API_METRICS_PORT)
- `pool.py`   the connections to the dimension, lent one request at a time
- `server.py` uvicorn and the /metrics listener until SIGTERM/SIGINT

This package reads the dimension only through `pin_pipelines.devstats`, the read side's face
(the Actor and `devstats.reads`, an Actor per read). It cannot import the operator side —
`devstats.dim` (the loader's guard and write), `devstats.operator` (the operator's Actor), the
loader and its face `devstats.loading`, the reconciliation: tests/unit/test_layering.py.
The server is imported lazily: `pin` loads FastAPI and uvicorn only for `pin api serve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pin_pipelines.config import Settings


def serve_api(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT (see `server.serve_api`)."""
    from pin_pipelines.api.server import serve_api as serve

    serve(settings)
