"""Users and their API keys: who may do what, and the hashes that prove a key.

A user has a :class:`Role` (``admin``: everything; ``member``: submits, and sees and acts on
their own evaluations; ``viewer``: reads everything, changes nothing), a weight in the fair share
of the queue and an optional cap on the ranks their evaluations hold at once. A key is
``rk_<id>_<secret>``: the id finds its row, and only a SHA-256 digest of the secret is stored
(:func:`hash_secret`), so the database never holds a key anyone could use. A key is printed once,
when made (``rayeval users add`` / ``rotate``); revoked keys stay listed with when they were
revoked. :class:`Accounts` reads and writes the ``users`` and ``api_keys`` tables. No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from rayeval.actors.errors import ConfigError
from rayeval.service.jobs.audit import Action, AuditTrail
from rayeval.service.jobs.records import EvaluationRecord
from rayeval.service.jobs.rows import BUILTIN_ADMIN, ApiKeyRow, UserRow
from rayeval.service.vocabulary.errors import (
    PermissionDeniedError,
    UserConflictError,
    UserNotFoundError,
    unknown_evaluation,
)

KEY_PREFIX = "rk"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
MAX_WEIGHT = 1000.0
MAX_RANKS_CAP = 100_000


class Role(StrEnum):
    """What a user may do."""

    ADMIN = "admin"
    MEMBER = "member"
    VIEWER = "viewer"


@dataclass(frozen=True)
class Principal:
    """Whoever a request or command acts as: a user's name and role."""

    name: str
    role: Role

    @property
    def sees_everything(self) -> bool:
        """Admins and viewers read every evaluation; members only their own."""
        return self.role is not Role.MEMBER

    @property
    def may_change(self) -> bool:
        """Whether this principal may submit, cancel or retry at all (viewers may not)."""
        return self.role is not Role.VIEWER

    def sees(self, owner: str) -> bool:
        """Whether an evaluation owned by ``owner`` exists for this principal."""
        return self.sees_everything or owner == self.name

    def acts_on(self, owner: str) -> bool:
        """Whether this principal may cancel or retry an evaluation owned by ``owner``."""
        return self.role is Role.ADMIN or (self.role is Role.MEMBER and owner == self.name)


#: Whoever acts on a server without keys, and the holder of the server's ``--api-token``.
BUILTIN_PRINCIPAL = Principal(BUILTIN_ADMIN, Role.ADMIN)


def check_access(
    record: EvaluationRecord, caller: Principal, change: bool = False
) -> EvaluationRecord:
    """``record`` if ``caller`` may read it (and, with ``change``, cancel or retry it).

    Raises:
        EvaluationNotFoundError: the caller may not see it (the answer of an unknown id).
        PermissionDeniedError: the caller sees it but reads only (a viewer).
    """
    if not caller.sees(record.owner):
        raise unknown_evaluation(record.id)
    if change and not caller.acts_on(record.owner):
        raise PermissionDeniedError(read_only(caller))
    return record


def read_only(caller: Principal) -> str:
    """The refusal of a change by ``caller``, who reads only."""
    return (
        f"{caller.name} is a {caller.role.value}: viewers read every evaluation and change "
        "nothing; ask an admin for a member's key (`rayeval users add NAME --role member`)"
    )


@dataclass(frozen=True)
class User:
    """One user as stored."""

    name: str
    role: Role
    weight: float
    max_ranks: int | None
    created_at: datetime


@dataclass(frozen=True)
class KeyInfo:
    """One key as listed: its public id, never its secret."""

    id: str
    user: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class Share:
    """A user's part in the fair share of the queue."""

    weight: float = 1.0
    max_ranks: int | None = None


def hash_secret(secret: str) -> str:
    """A key's secret as stored: ``sha256$<hex>``. A secret is 256 random bits, so a fast hash
    is as safe as a slow one (nothing to guess from a dictionary) and every request can check it
    (microseconds; no verdict kept in memory)."""
    return "sha256$" + hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored: str) -> bool:
    """Whether ``secret`` is the one ``stored`` was made from: :func:`hash_secret`'s form, or
    the scrypt form (``scrypt$n$r$p$<salt hex>$<hash hex>``) of keys made before it, which
    :meth:`Accounts.holder`'s caller upgrades (:meth:`Accounts.upgrade_hash`)."""
    scheme, _, rest = stored.partition("$")
    if scheme == "sha256":
        return hmac.compare_digest(hash_secret(secret), stored)
    try:
        n, r, p, salt, digest = rest.split("$")
        computed = hashlib.scrypt(
            secret.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p), dklen=32
        )
    except ValueError:
        return False
    return scheme == "scrypt" and hmac.compare_digest(computed.hex(), digest)


def split_key(key: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a key in rayeval's form, else None."""
    prefix, _, rest = key.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != KEY_PREFIX or not key_id or not secret:
        return None
    return key_id, secret


def check_user_fields(
    name: str | None = None,
    role: str | None = None,
    weight: float | None = None,
    max_ranks: int | None = None,
) -> None:
    """Refuse a bad name, role, weight or cap, naming each and its fix.

    Raises:
        ConfigError: every problem in one message.
    """
    problems = []
    if name is not None and not NAME_PATTERN.fullmatch(name):
        problems.append(
            f"name: {name!r} is not a user name: 1 to 64 of a-z, 0-9, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    if name == BUILTIN_ADMIN:
        problems.append(
            f"name: {BUILTIN_ADMIN!r} is the server's --api-token (the built-in admin): pick "
            "another name"
        )
    if role is not None and role not in set(Role):
        problems.append(f"role: {role!r} is not a role: use admin, member or viewer")
    if weight is not None and not 0 < weight <= MAX_WEIGHT:
        problems.append(
            f"weight: {weight!r} is out of range: a share of the queue above 0 and at most "
            f"{MAX_WEIGHT:g} (1 is everyone's default)"
        )
    if max_ranks is not None and not 1 <= max_ranks <= MAX_RANKS_CAP:
        problems.append(
            f"max_ranks: {max_ranks!r} is out of range: at least 1 rank, at most "
            f"{MAX_RANKS_CAP} (leave it unset for no cap)"
        )
    if problems:
        raise ConfigError("; ".join(problems))


class Accounts:
    """Reads and writes users and keys.

    Args:
        sessions: Opens a session of the service's database (the store's).
        audit: Where each change is recorded, with who made it (``actor``).
    """

    def __init__(
        self, sessions: Callable[[], AbstractContextManager[Session]], audit: AuditTrail
    ) -> None:
        self._sessions = sessions
        self._audit = audit

    # ------------------------------------------------------------------------ users
    def add_user(
        self,
        name: str,
        role: str,
        weight: float = 1.0,
        max_ranks: int | None = None,
        actor: str = BUILTIN_ADMIN,
    ) -> tuple[User, str]:
        """Store a new user and make their first key.

        Returns:
            The user and the key (shown once: only its hash is stored).

        Raises:
            ConfigError: a bad name, role, weight or cap.
            UserConflictError: the name is taken.
        """
        check_user_fields(name, role, weight, max_ranks)
        with self._sessions() as session, session.begin():
            if session.get(UserRow, name) is not None:
                raise UserConflictError(
                    f"user {name!r} exists: pick another name, or make a new key with "
                    f"`rayeval users rotate {name}`"
                )
            row = UserRow(
                name=name, role=role, weight=weight, max_ranks=max_ranks, created_at=_now()
            )
            session.add(row)
            session.flush()  # the key's row refers to it
            key = _new_key(session, name)
            user = _user(row)
        detail = {"role": role, "weight": weight, "max_ranks": max_ranks, "key": _key_id(key)}
        self._audit.record(actor, Action.USER_ADD, name, detail)
        return user, key

    def update_user(
        self,
        name: str,
        role: str | None = None,
        weight: float | None = None,
        max_ranks: int | None = None,
        clear_cap: bool = False,
        actor: str = BUILTIN_ADMIN,
    ) -> User:
        """Change a user's role, weight or cap (``clear_cap``: no cap).

        Raises:
            ConfigError: a bad role, weight or cap.
            UserNotFoundError: no such user.
        """
        check_user_fields(role=role, weight=weight, max_ranks=max_ranks)
        with self._sessions() as session, session.begin():
            row = _user_row(session, name)
            row.role = role or row.role
            row.weight = weight if weight is not None else row.weight
            row.max_ranks = (
                None if clear_cap else (row.max_ranks if max_ranks is None else max_ranks)
            )
            user = _user(row)
        detail = {"role": user.role.value, "weight": user.weight, "max_ranks": user.max_ranks}
        self._audit.record(actor, Action.USER_UPDATE, name, detail)
        return user

    def users(self) -> list[User]:
        """Every user, by name."""
        with self._sessions() as session:
            return [_user(r) for r in session.scalars(select(UserRow).order_by(UserRow.name))]

    def user(self, name: str) -> User:
        """One user.

        Raises:
            UserNotFoundError: no such user.
        """
        with self._sessions() as session:
            return _user(_user_row(session, name))

    def shares(self) -> dict[str, Share]:
        """Every user's weight and cap (users not listed: weight 1, no cap)."""
        with self._sessions() as session:
            rows = session.execute(select(UserRow.name, UserRow.weight, UserRow.max_ranks)).all()
        return {name: Share(weight, cap) for name, weight, cap in rows}

    def any_user(self) -> bool:
        """Whether at least one user exists (then every request needs a key)."""
        with self._sessions() as session:
            return bool(session.scalar(select(func.count()).select_from(UserRow)))

    # ------------------------------------------------------------------------- keys
    def rotate(self, name: str, actor: str = BUILTIN_ADMIN) -> str:
        """Revoke every live key of the user and make a new one (shown once).

        Raises:
            UserNotFoundError: no such user.
        """
        with self._sessions() as session, session.begin():
            _user_row(session, name)
            session.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.user_name == name, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=_now())
            )
            key = _new_key(session, name)
        self._audit.record(actor, Action.KEY_ROTATE, name, {"key": _key_id(key)})
        return key

    def revoke(self, name: str, key_id: str | None = None, actor: str = BUILTIN_ADMIN) -> list[str]:
        """Revoke one key of the user (``key_id``) or all of them; the ids revoked.

        Raises:
            UserNotFoundError: no such user, or no live key ``key_id`` of theirs.
        """
        with self._sessions() as session, session.begin():
            _user_row(session, name)
            query = select(ApiKeyRow).where(
                ApiKeyRow.user_name == name, ApiKeyRow.revoked_at.is_(None)
            )
            if key_id is not None:
                query = query.where(ApiKeyRow.id == key_id)
            rows = list(session.scalars(query))
            if key_id is not None and not rows:
                raise UserNotFoundError(
                    f"user {name!r} has no live key {key_id!r}: list them with `rayeval users list`"
                )
            for row in rows:
                row.revoked_at = _now()
            revoked = [row.id for row in rows]
        self._audit.record(actor, Action.KEY_REVOKE, name, {"keys": revoked})
        return revoked

    def keys(self, name: str | None = None) -> list[KeyInfo]:
        """Every key (of one user), newest first, revoked ones included."""
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at.desc())
        if name is not None:
            query = query.where(ApiKeyRow.user_name == name)
        with self._sessions() as session:
            return [
                KeyInfo(r.id, r.user_name, r.created_at, r.revoked_at)
                for r in session.scalars(query)
            ]

    def upgrade_hash(self, key_id: str, secret: str) -> None:
        """Store a proven key's hash in :func:`hash_secret`'s form (a key made when keys were
        stored as scrypt hashes), so that its next check is fast."""
        with self._sessions() as session, session.begin():
            row = session.get(ApiKeyRow, key_id)
            if row is not None and not row.hash.startswith("sha256$"):
                row.hash = hash_secret(secret)

    def holder(self, key_id: str) -> tuple[Principal, str] | None:
        """The user a live key id belongs to and the key's stored hash (None: unknown or
        revoked)."""
        with self._sessions() as session:
            found = session.execute(
                select(UserRow.name, UserRow.role, ApiKeyRow.hash)
                .join(ApiKeyRow, ApiKeyRow.user_name == UserRow.name)
                .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            ).first()
        if found is None:
            return None
        name, role, stored = found
        return Principal(name, Role(role)), stored


def _new_key(session: Session, name: str) -> str:
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    session.add(ApiKeyRow(id=key_id, user_name=name, hash=hash_secret(secret), created_at=_now()))
    return f"{KEY_PREFIX}_{key_id}_{secret}"


def _key_id(key: str) -> str:
    return (split_key(key) or ("", ""))[0]


def _user_row(session: Session, name: str) -> UserRow:
    row = session.get(UserRow, name)
    if row is None:
        raise UserNotFoundError(
            f"no user {name!r}: list them with `rayeval users list`, add one with "
            f"`rayeval users add {name} --role member`"
        )
    return row


def _user(row: UserRow) -> User:
    return User(row.name, Role(row.role), row.weight, row.max_ranks, row.created_at)


def _now() -> datetime:
    return datetime.now(UTC)
