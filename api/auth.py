"""Who a request acts as: a user's API key, the server's ``--api-token``, or nobody.

``Authorization: Bearer <credential>`` carries either the server's ``--api-token`` (the built-in
admin, as before users existed) or a user's key (``rk_<id>_<secret>``, made by ``rayeval users
add`` or ``rotate``). A key is looked up by its id on every request, so a revoked key stops
working at once, even when another process (``rayeval users revoke``) revoked it, and its secret
checked against the stored SHA-256 digest (a secret is 256 random bits: a slow hash would guard
nothing more and cost every request). A key stored as scrypt, as keys were before, is upgraded the
first time it is proven.

Without a credential, a server that has no ``--api-token``, no ``--require-api-keys`` and no user
answers everyone as the built-in admin (a loopback-only server, as before users existed); once
one of those exists, it answers 401. HTTP statuses are this layer's: 401 here, 403 for a role
that forbids the request (``require_role``). This module never imports torch.
"""

from __future__ import annotations

import secrets
import time

from fastapi import HTTPException, status

from rayeval.api.settings import Settings
from rayeval.service.jobs.accounts import (
    BUILTIN_PRINCIPAL,
    Accounts,
    Principal,
    Role,
    secret_matches,
    split_key,
)
from rayeval.service.vocabulary.errors import PermissionDeniedError

#: How long "no user exists yet" is believed before the database is asked again.
_ANY_USER_TTL_S = 2.0

UNAUTHORIZED = (
    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with your API key "
    "(an admin makes one with `rayeval users add NAME --role member`) or the server's "
    "--api-token (RAYEVAL_API_TOKEN)"
)
REVOKED = (
    "this API key is revoked or unknown: ask an admin for a new one (`rayeval users rotate NAME`)"
)


class Authenticator:
    """Turns a request's bearer credential into a :class:`Principal`.

    Args:
        settings: The server's settings (its token; whether keys are always required).
        accounts: Users and keys (the store's).
    """

    def __init__(self, settings: Settings, accounts: Accounts) -> None:
        self._token = settings.api_token
        self._keys_required = settings.keys_required
        self._accounts = accounts
        self._open_until = 0.0

    def principal(self, credential: str | None) -> Principal:
        """Who the request acts as.

        Raises:
            HTTPException: 401 (missing, wrong, revoked or unknown key).
        """
        if not credential:
            if self._open():
                return BUILTIN_PRINCIPAL
            raise _unauthorized(UNAUTHORIZED)
        if self._token is not None and secrets.compare_digest(
            credential.encode(), self._token.get_secret_value().encode()
        ):
            return BUILTIN_PRINCIPAL
        parts = split_key(credential)
        if parts is None:
            raise _unauthorized(UNAUTHORIZED)
        key_id, secret = parts
        found = self._accounts.holder(key_id)
        if found is None:
            raise _unauthorized(REVOKED)
        caller, stored = found
        if not secret_matches(secret, stored):
            raise _unauthorized(UNAUTHORIZED)
        if not stored.startswith("sha256$"):  # a key made before keys were stored so
            self._accounts.upgrade_hash(key_id, secret)
        return caller

    def _open(self) -> bool:
        """Whether a request without a credential is the built-in admin's."""
        if self._keys_required:
            return False
        now = time.monotonic()
        if now < self._open_until:
            return True
        if self._accounts.any_user():
            return False
        self._open_until = now + _ANY_USER_TTL_S
        return True


def require_role(caller: Principal, *roles: Role) -> Principal:
    """``caller`` if their role is one of ``roles``.

    Raises:
        PermissionDeniedError: naming the roles that may.
    """
    if caller.role not in roles:
        allowed = " or ".join(role.value for role in roles)
        raise PermissionDeniedError(
            f"{caller.name} is a {caller.role.value}: this needs an {allowed} key "
            "(an admin changes roles with `rayeval users set NAME --role ROLE`)"
        )
    return caller


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=detail,
        headers={"WWW-Authenticate": "Bearer"},
    )
