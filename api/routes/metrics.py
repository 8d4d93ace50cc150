"""``/metrics``: the service's Prometheus metrics (see :mod:`rayeval.api.metrics` for the families).

With an API token the endpoint requires it, like the data endpoints (evaluation ids are labels):
give Prometheus the token as ``authorization: {credentials_file: ...}`` (deploy/prometheus/).
It shows every evaluation, so it takes an admin's or a viewer's key (or the token), not a
member's.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rayeval.api.deps import ReaderDep, ServicesDep, require_token
from rayeval.api.metrics import build_registry
from rayeval.api.schemas import ErrorBody

router = APIRouter(
    tags=["metrics"],
    dependencies=[Depends(require_token)],
    responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 403: {"model": ErrorBody}},
)


@router.get(
    "/metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
    summary="Prometheus metrics",
)
def metrics(request: Request, services: ServicesDep, reader: ReaderDep) -> Response:
    """Evaluations by state, queue length, and per running evaluation its rates, ETA, cache
    hits, per-replica throughput and utilisation, per-rank memory, load and start-up seconds."""
    # One registry per running service (a lifespan restart brings a new store).
    cached: tuple[object, CollectorRegistry] | None = getattr(
        request.app.state, "metrics_registry", None
    )
    if cached is None or cached[0] is not services.store:
        cached = request.app.state.metrics_registry = (
            services.store,
            build_registry(services.store),
        )
    registry = cached[1]
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
