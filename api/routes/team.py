"""``/me``, ``/users`` and ``/audit``: who the caller is; users, keys and the audit trail (admins).

``rayeval users`` manages the same users on the database directly (the operator's shell); these
routes let an admin do it over HTTP. A new or rotated key is in the answer once; only its hash
is stored. Every change is on the audit trail, which only admins read.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, status
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from rayeval.api.deps import AdminDep, CallerDep, StoreDep, require_token
from rayeval.api.schemas import ErrorBody
from rayeval.service.jobs.accounts import MAX_RANKS_CAP, MAX_WEIGHT, KeyInfo, Role, User
from rayeval.service.jobs.audit import Action

router = APIRouter(
    tags=["team"],
    dependencies=[Depends(require_token)],
    responses={code: {"model": ErrorBody} for code in (401, 403, 404, 409, 422)},
)


class Me(BaseModel):
    """Who the caller is."""

    name: str
    role: Role


class UserPublic(BaseModel):
    """A user and their keys (ids only: a key is shown once, when it is made)."""

    name: str
    role: Role
    weight: float
    max_ranks: int | None
    created_at: datetime
    keys: list[KeyPublic]


class KeyPublic(BaseModel):
    """One key's public id and dates."""

    id: str
    created_at: datetime
    revoked_at: datetime | None


class UserCreate(BaseModel):
    """A new user."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="1 to 64 of a-z, 0-9, '.', '_' and '-'.")
    role: Role
    weight: StrictFloat | StrictInt = Field(
        1.0, gt=0, le=MAX_WEIGHT, description="Share of the queue (1: everyone's default)."
    )
    max_ranks: StrictInt | None = Field(
        None, ge=1, le=MAX_RANKS_CAP, description="Most ranks held at once (null: no cap)."
    )


class UserUpdate(BaseModel):
    """Changes to a user (absent fields stay; ``max_ranks: null`` removes the cap)."""

    model_config = ConfigDict(extra="forbid")

    role: Role | None = None
    weight: StrictFloat | StrictInt | None = Field(None, gt=0, le=MAX_WEIGHT)
    max_ranks: StrictInt | None = Field(None, ge=1, le=MAX_RANKS_CAP)


class NewKey(BaseModel):
    """A key, shown this once: keep it; the server stores only its hash."""

    user: UserPublic
    key: str


class AuditPublic(BaseModel):
    """One action on the audit trail."""

    at: datetime
    actor: str
    action: Action
    target: str
    detail: dict[str, Any]


class AuditPage(BaseModel):
    """Audit entries, newest first."""

    items: list[AuditPublic]
    total: int


@router.get("/me", response_model=Me, summary="Who the caller is")
def me(caller: CallerDep) -> Me:
    """The caller's name and role (the built-in admin for the server's --api-token)."""
    return Me(name=caller.name, role=caller.role)


@router.get("/users", response_model=list[UserPublic], summary="Users and their keys (admins)")
def list_users(store: StoreDep, admin: AdminDep) -> list[UserPublic]:
    """Every user with the ids of their keys, revoked ones included."""
    keys = store.accounts.keys()
    return [_user(user, keys) for user in store.accounts.users()]


@router.post(
    "/users",
    status_code=status.HTTP_201_CREATED,
    response_model=NewKey,
    summary="Add a user (admins)",
)
def add_user(body: UserCreate, store: StoreDep, admin: AdminDep) -> NewKey:
    """A new user and their first key (shown once). 409 if the name is taken."""
    user, key = store.accounts.add_user(
        body.name, body.role.value, float(body.weight), body.max_ranks, actor=admin.name
    )
    return NewKey(user=_user(user, store.accounts.keys(user.name)), key=key)


@router.patch("/users/{name}", response_model=UserPublic, summary="Change a user (admins)")
def update_user(name: str, body: UserUpdate, store: StoreDep, admin: AdminDep) -> UserPublic:
    """Change a user's role, weight or cap. 404 for an unknown user."""
    given = body.model_fields_set
    user = store.accounts.update_user(
        name,
        role=body.role.value if body.role is not None else None,
        weight=float(body.weight) if body.weight is not None else None,
        max_ranks=body.max_ranks,
        clear_cap="max_ranks" in given and body.max_ranks is None,
        actor=admin.name,
    )
    return _user(user, store.accounts.keys(name))


@router.post("/users/{name}/keys", response_model=NewKey, summary="Rotate a user's key (admins)")
def rotate_key(name: str, store: StoreDep, admin: AdminDep) -> NewKey:
    """Revoke every live key of the user and make a new one (shown once)."""
    key = store.accounts.rotate(name, actor=admin.name)
    return NewKey(user=_user(store.accounts.user(name), store.accounts.keys(name)), key=key)


@router.delete(
    "/users/{name}/keys/{key_id}", response_model=UserPublic, summary="Revoke a key (admins)"
)
def revoke_key(name: str, key_id: str, store: StoreDep, admin: AdminDep) -> UserPublic:
    """Revoke one key: it stops working at once. 404 for an unknown user or key."""
    store.accounts.revoke(name, key_id, actor=admin.name)
    return _user(store.accounts.user(name), store.accounts.keys(name))


@router.get("/audit", response_model=AuditPage, summary="The audit trail (admins)")
def audit(
    store: StoreDep,
    admin: AdminDep,
    actor: Annotated[str | None, Query(max_length=64)] = None,
    action: Action | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**53)] = 0,
) -> AuditPage:
    """Who submitted, cancelled, retried or preempted what, and who created, changed, rotated
    or revoked which user or key, newest first."""
    entries, total = store.audit.page(limit=limit, offset=offset, actor=actor, action=action)
    return AuditPage(
        items=[AuditPublic(**entry.__dict__) for entry in entries],
        total=total,
    )


def _user(user: User, keys: list[KeyInfo]) -> UserPublic:
    return UserPublic(
        name=user.name,
        role=user.role,
        weight=user.weight,
        max_ranks=user.max_ranks,
        created_at=user.created_at,
        keys=[
            KeyPublic(id=k.id, created_at=k.created_at, revoked_at=k.revoked_at)
            for k in keys
            if k.user == user.name
        ],
    )
