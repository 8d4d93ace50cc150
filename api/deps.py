"""Request dependencies: the service objects of the running app, and bearer-token auth.

Handlers declare what they need with the ``Annotated`` aliases below (``ManagerDep``, ...);
``require_token`` guards every data endpoint when the server has an API token.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rayeval.api.settings import Settings
from rayeval.api.views import EvaluationViews, EventFeed
from rayeval.service.jobs.manager import EvaluationManager
from rayeval.service.jobs.store import EvaluationStore
from rayeval.service.jobs.tasks import TaskCatalog


@dataclass(frozen=True)
class Services:
    """What the app's lifespan builds and the handlers use."""

    settings: Settings
    store: EvaluationStore
    catalog: TaskCatalog
    manager: EvaluationManager
    views: EvaluationViews
    feed: EventFeed


def get_services(request: Request) -> Services:
    """The running app's services (set by its lifespan)."""
    services: Services = request.app.state.services
    return services


def get_settings(request: Request) -> Settings:
    """The app's settings (available before the lifespan has run)."""
    settings: Settings = request.app.state.settings
    return settings


def get_store(services: Annotated[Services, Depends(get_services)]) -> EvaluationStore:
    """The service's database."""
    return services.store


def get_manager(services: Annotated[Services, Depends(get_services)]) -> EvaluationManager:
    """The evaluation manager."""
    return services.manager


def get_views(services: Annotated[Services, Depends(get_services)]) -> EvaluationViews:
    """The in-memory answers of status reads."""
    return services.views


def get_feed(services: Annotated[Services, Depends(get_services)]) -> EventFeed:
    """Events read once per change for every stream."""
    return services.feed


ServicesDep = Annotated[Services, Depends(get_services)]
ViewsDep = Annotated[EvaluationViews, Depends(get_views)]
FeedDep = Annotated[EventFeed, Depends(get_feed)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[EvaluationStore, Depends(get_store)]
ManagerDep = Annotated[EvaluationManager, Depends(get_manager)]

_bearer = HTTPBearer(auto_error=False, description="The server's --api-token, when it has one.")


def require_token(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Refuse the request unless it carries the server's bearer token (no-op without a token).

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer``.
    """
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value().encode()
    given = credentials.credentials.encode() if credentials is not None else b""
    if not secrets.compare_digest(given, expected):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong API token: send the header 'Authorization: Bearer <token>' "
            "with the server's --api-token (RAYEVAL_API_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )
