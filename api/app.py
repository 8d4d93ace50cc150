"""The FastAPI application: ``create_app(settings)`` wires routes, errors and the service.

The lifespan connects to Ray (reusing a Ray session already initialised in this process, else
``--ray-address``/``$RAY_ADDRESS``, else an embedded local Ray), opens the database, starts the
background scan of lm-eval's task index and the evaluation manager, and stops them on shutdown.
Domain errors become HTTP statuses here and only here. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from sqlalchemy.exc import SQLAlchemyError

from rayeval.actors.errors import ConfigError, LayoutError, RayEvalError
from rayeval.api.auth import Authenticator
from rayeval.api.deps import Services
from rayeval.api.routes import (
    compare,
    dashboard,
    evaluations,
    health,
    insights,
    metrics,
    sweeps,
    team,
)
from rayeval.api.settings import Settings
from rayeval.api.views import EvaluationViews, EventFeed
from rayeval.service.engine.dispatch.cluster import connect
from rayeval.service.jobs.manager import EvaluationManager
from rayeval.service.jobs.options import ManagerOptions
from rayeval.service.jobs.store import EvaluationStore
from rayeval.service.jobs.tasks import TaskCatalog
from rayeval.service.jobs.validation import ServerPolicy
from rayeval.service.vocabulary.doors import Door, render
from rayeval.service.vocabulary.errors import (
    EvaluationNotFoundError,
    EvaluationStateError,
    PermissionDeniedError,
    ServiceNotReadyError,
    UserConflictError,
    UserNotFoundError,
)

logger = logging.getLogger(__name__)

#: HTTP status of each domain error (first match wins; subclasses before their bases).
_STATUS_OF_ERROR: tuple[tuple[type[RayEvalError], int], ...] = (
    (EvaluationNotFoundError, 404),
    (UserNotFoundError, 404),
    (PermissionDeniedError, 403),
    (EvaluationStateError, 409),
    (UserConflictError, 409),
    (ServiceNotReadyError, 503),
    (LayoutError, 422),
    (ConfigError, 422),
)


#: Where Swagger UI's and ReDoc's assets are served from (a folder of the fastapi-offline package).
DOCS_ASSETS_URL = "/docs-assets"


def create_app(settings: Settings) -> FastAPI:
    """Build the application for ``settings`` (nothing starts until its lifespan runs).

    ``/docs`` (Swagger UI) loads its script, style and icon from this server (fastapi-offline
    ships them): FastAPI's own page fetches them from a CDN and stays blank on a cluster without
    internet. There is no ``/redoc``: ReDoc's bundle fetches its logo from its CDN whatever the
    page says, and ``/docs`` shows the same document.
    """
    app = FastAPIOffline(
        title="rayeval",
        summary="Distributed lm-evaluation-harness on Ray, with FSDP2-sharded models.",
        version="0.1.0",
        lifespan=_lifespan,
        redoc_url=None,
        static_url=DOCS_ASSETS_URL,
    )
    app.state.settings = settings
    if not settings.keys_required:
        app.add_middleware(TrustedHosts, allowed=settings.trusted_hosts)  # DNS rebinding
    app.include_router(health.router)
    app.include_router(evaluations.router)
    app.include_router(insights.router)
    app.include_router(metrics.router)
    app.include_router(compare.router)
    app.include_router(sweeps.router)
    app.include_router(dashboard.router)
    app.include_router(team.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    app.add_exception_handler(RayEvalError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(SQLAlchemyError, _database_error)  # type: ignore[arg-type]
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, true to this server: no bearer requirement when it has no token."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            routes=app.routes,
        )
        if not app.state.settings.keys_required:
            schema.get("components", {}).pop("securitySchemes", None)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.pop("security", None)
        app.openapi_schema = schema
    return app.openapi_schema


class TrustedHosts:
    """Answer only requests whose Host header names this server (a tokenless server must not be
    reachable through another name: DNS rebinding). Pure ASGI, so streams pass untouched."""

    def __init__(self, app: Any, allowed: list[str]) -> None:
        self.app = app
        self.allowed = {host.lower().strip("[]") for host in allowed}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = headers.get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.strip("[]") not in self.allowed:
                response = JSONResponse(
                    {
                        "detail": f"Host header {host!r} is not served by this server without an "
                        "API token: use its address, or the operator adds the name with "
                        "--allowed-host (or sets --api-token)"
                    },
                    status_code=400,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.allow_code_execution:  # fail closed: no sandbox, no server that runs code
        from rayeval.service.sandbox.bwrap import check_available

        await asyncio.to_thread(check_available)
    connection = await asyncio.to_thread(
        connect,
        settings.ray_address,
        embedded_cpus=settings.num_cpus,
        namespace=settings.ray_namespace,
        cluster_logs=False,
    )
    owns_ray = connection.started
    store = EvaluationStore(settings.effective_database_url)
    store.create_schema()
    catalog = await asyncio.to_thread(TaskCatalog, settings.include_paths)
    catalog.start_builtin_index()
    manager = EvaluationManager(
        store,
        catalog,
        ManagerOptions(
            namespace=settings.ray_namespace,
            poll_interval_s=settings.poll_interval_s,
            runner_unreachable_s=settings.runner_unreachable_s,
            cancel_timeout_s=settings.cancel_timeout_s,
            task_index_wait_s=settings.task_index_wait_s,
            policy=ServerPolicy(
                model_roots=tuple(settings.model_roots),
                allow_hub_models=settings.allow_hub_models,
                allow_remote_code=settings.allow_remote_code,
                allow_code_execution=settings.allow_code_execution,
                trackers=settings.trackers.names,
            ),
            response_cache=settings.response_cache_prefix,
            stall_timeout_s=settings.stall_timeout_s,
            warm_replicas=settings.warm_replicas,
            runner_scan_timeout_s=settings.runner_scan_timeout_s,
            trackers=settings.trackers,
            rank_niceness=settings.rank_niceness,
        ),
    )
    await asyncio.to_thread(manager.start)
    views = EvaluationViews(
        store, evaluations.public_json(store, manager), ttl_s=settings.poll_interval_s
    )
    app.state.services = Services(
        settings=settings,
        store=store,
        catalog=catalog,
        manager=manager,
        views=views,
        feed=EventFeed(store),
        auth=Authenticator(settings, store.accounts),
    )
    logger.info("rayeval service ready (database %s)", store.url)
    try:
        yield
    finally:
        await asyncio.to_thread(manager.stop)
        views.close()
        store.close()
        if owns_ray:
            ray.shutdown()


async def _domain_error(request: Request, exc: RayEvalError) -> JSONResponse:
    status = next((code for kind, code in _STATUS_OF_ERROR if isinstance(exc, kind)), 500)
    headers = {"Retry-After": "5"} if status == 503 else None
    if status == 500:
        logger.error("unexpected service error on %s: %s", request.url.path, exc)
    return JSONResponse({"detail": render(exc, Door.REST)}, status_code=status, headers=headers)


async def _database_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
    logger.error("database error on %s: %s", request.url.path, exc)
    return JSONResponse(
        {"detail": "the service's database is unavailable or busy: retry shortly"},
        status_code=503,
        headers={"Retry-After": "5"},
    )


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type", "")
    errors = [_explain(error, content_type) for error in exc.errors()]
    return JSONResponse(
        {
            "detail": "; ".join(dict.fromkeys(message for message, _ in errors)),
            "errors": [item for _, item in errors],
        },
        status_code=422,
    )


def _explain(error: dict[str, Any], content_type: str = "") -> tuple[str, dict[str, Any]]:
    """One validation error as a sentence that names the fix, plus its machine-readable form.

    ``content_type`` is the request's header: a body that is not a JSON object at all is most
    often one sent without ``Content-Type: application/json`` (``curl -d`` sends a form).
    """
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    where = ".".join(loc) or "body"
    kind = error.get("type", "")
    message = render(str(error.get("msg", "")).removeprefix("Value error, "), Door.REST)
    whole_body = not loc and tuple(error.get("loc", ())) == ("body",)
    if whole_body and kind in ("missing", "model_attributes_type", "dict_type"):
        text = _whole_body_problem(kind, content_type)
    elif kind == "extra_forbidden":
        text = f"unknown field {where!r}: remove it (accepted fields are listed at /docs)"
    elif kind == "json_invalid":
        reason = error.get("ctx", {}).get("error", message)
        text = f"the body is not valid JSON ({reason}): send a JSON object"
    elif kind == "missing":
        text = f"{where}: required field missing"
    else:
        text = f"{where}: {message}"
    return text, {"loc": loc, "msg": message, "type": kind}


def _whole_body_problem(kind: str, content_type: str) -> str:
    """Why a body is not a JSON object: no body, the wrong Content-Type, or another JSON value."""
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json":
        sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return (
            f"send the body as a JSON object with the header Content-Type: application/json "
            f"(this request had {sent}; curl: -H 'Content-Type: application/json')"
        )
    if kind == "missing":
        return "the body is empty: send a JSON object (the accepted fields are listed at /docs)"
    return "the body must be a JSON object (the accepted fields are listed at /docs)"
