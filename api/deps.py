"""Request dependencies: the service objects of the running app, and who the caller is.

Handlers declare what they need with the ``Annotated`` aliases below (``ManagerDep``,
``CallerDep``, ...). ``CallerDep`` is the request's :class:`rayeval.service.jobs.accounts.Principal`
(:mod:`rayeval.api.auth`); ``require_token`` guards a whole router (any authenticated caller),
``AdminDep`` and ``ReaderDep`` (admins and viewers: who reads everything) a route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rayeval.api.auth import Authenticator, require_role
from rayeval.api.settings import Settings
from rayeval.api.views import EvaluationViews, EventFeed
from rayeval.service.jobs.accounts import Principal, Role
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
    auth: Authenticator


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

_bearer = HTTPBearer(auto_error=False, description="A user's API key, or the server's --api-token.")


def get_caller(
    services: ServicesDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Who the request acts as (:class:`rayeval.api.auth.Authenticator`).

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer``.
    """
    return services.auth.principal(credentials.credentials if credentials is not None else None)


CallerDep = Annotated[Principal, Depends(get_caller)]


def require_token(caller: CallerDep) -> None:
    """Refuse the request unless it carries a valid key or token (open servers: anyone)."""


def get_admin(caller: CallerDep) -> Principal:
    """The caller, an admin (403 otherwise)."""
    return require_role(caller, Role.ADMIN)


def get_reader(caller: CallerDep) -> Principal:
    """The caller, an admin or a viewer: someone who reads every evaluation (403 otherwise)."""
    return require_role(caller, Role.ADMIN, Role.VIEWER)


AdminDep = Annotated[Principal, Depends(get_admin)]
ReaderDep = Annotated[Principal, Depends(get_reader)]
