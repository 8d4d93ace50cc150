"""``/healthz``: liveness, open without a token (for load balancers and probes)."""

from __future__ import annotations

import ray
from fastapi import APIRouter

from rayeval.api.deps import ServicesDep
from rayeval.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz(services: ServicesDep) -> Health:
    """The service is up; says whether Ray is connected and lm-eval's task index is ready."""
    return Health(ray_connected=ray.is_initialized(), task_index=services.catalog.builtin_state)
