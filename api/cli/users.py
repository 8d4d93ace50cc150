"""``rayeval users``: add, list, change, rotate and revoke users and their API keys.

It works on the server's database directly, as its operator at the shell, with ``rayeval
serve``'s own ``--data-dir`` and ``--database-url`` (and their ``RAYEVAL_*`` variables), so the
first admin can be made before the server has any. Both default as ``serve``'s do: the SQLite file
under ``.rayeval/service`` of the current folder, which ``make run`` serves. Every action says
which database it used; only ``add`` creates a SQLite database that is not there yet (saying so),
the others refuse a missing one, naming the flags that find the server's. A new key is printed
once: the database keeps only its hash. Every change goes to the audit trail as ``<login> (cli)``.
A running server sees the changes at once (it reads keys per request).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

from rayeval.actors.errors import ConfigError, RayEvalError

ROLES = ("admin", "member", "viewer")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``users`` and its subcommands."""
    users = subparsers.add_parser(
        "users",
        help="manage users and API keys (on the server's database)",
        description="Users and their API keys, on the database `rayeval serve` uses (same "
        "--data-dir / --database-url, same RAYEVAL_DATA_DIR / RAYEVAL_DATABASE_URL, same "
        "default: .rayeval/service, what `make run` serves). Each action names the database it "
        "used. New keys are printed once.",
    )
    actions = users.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="add a user and print their first key")
    add.add_argument("name", help="1 to 64 of a-z, 0-9, '.', '_' and '-'")
    add.add_argument("--role", required=True, choices=ROLES)
    _add_share_flags(add)
    actions.add_parser("list", help="list users and their keys (ids only)")
    change = actions.add_parser("set", help="change a user's role, weight or cap")
    change.add_argument("name")
    change.add_argument("--role", choices=ROLES, default=None)
    _add_share_flags(change)
    change.add_argument("--no-cap", action="store_true", help="remove the user's cap")
    rotate = actions.add_parser("rotate", help="revoke a user's keys and print a new one")
    rotate.add_argument("name")
    revoke = actions.add_parser("revoke", help="revoke a user's keys (or one, with --key)")
    revoke.add_argument("name")
    revoke.add_argument("--key", default=None, metavar="KEY_ID", help="only this key id")
    for action in actions.choices.values():
        _add_database_flags(action)


def _add_share_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weight",
        type=float,
        default=None,
        help="share of the queue, above 0 and at most 1000 (default 1: an equal share)",
    )
    parser.add_argument(
        "--max-ranks",
        dest="max_ranks",
        type=int,
        default=None,
        metavar="N",
        help="most ranks the user's evaluations hold at once (default: no cap)",
    )


def _add_database_flags(parser: argparse.ArgumentParser) -> None:
    """``rayeval serve``'s own --data-dir and --database-url, from the same Settings fields."""
    from rayeval.api.cli.settings_flags import add_settings_flags
    from rayeval.api.settings import Settings

    group = parser.add_argument_group("the database (as rayeval serve's)")
    add_settings_flags(group, Settings, only={"data_dir", "database_url"})


def main(args: argparse.Namespace) -> int:
    """Run one ``users`` action.

    Returns:
        The exit status: 0; 1 when the database answers no (an unknown user or key, a name
        taken); 2 for input that cannot be used (a bad value, a database that is not there).
    """
    from rayeval.service.vocabulary.errors import UserConflictError, UserNotFoundError

    try:
        store = _store(args)
        try:
            return _act(store, args)
        finally:
            store.close()
    except (UserNotFoundError, UserConflictError) as exc:
        print(f"rayeval users {args.users_command}: error: {exc}", file=sys.stderr)
        return 1
    except (RayEvalError, ValueError) as exc:
        print(f"rayeval users {args.users_command}: error: {exc}", file=sys.stderr)
        return 2


def _store(args: argparse.Namespace) -> Any:
    """The server's store, named on standard error; a missing SQLite file is made by ``add``
    only.

    Raises:
        ConfigError: no SQLite database where the flags (or their defaults) point, for any
            action but ``add``.
    """
    from rayeval.api.settings import Settings
    from rayeval.service.jobs.store import EvaluationStore

    given = {k: getattr(args, k) for k in ("data_dir", "database_url") if getattr(args, k)}
    settings = Settings(**given)
    where = _describe(settings)
    if not settings.database_url:
        database = settings.data_dir / "rayeval.db"
        if not database.is_file():
            if args.users_command != "add":
                raise ConfigError(
                    f"no database at {database.resolve()}: give the server's --data-dir (or "
                    "--database-url; or set RAYEVAL_DATA_DIR / RAYEVAL_DATABASE_URL), or run "
                    "this where the server runs (`make run` serves .rayeval/service in the "
                    "repository)"
                )
            where = f"{where}, new: `rayeval serve --data-dir {settings.data_dir}` serves it"
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    print(f"rayeval users: database {where}", file=sys.stderr)
    store = EvaluationStore(settings.effective_database_url)
    store.create_schema()
    return store


def _describe(settings: Any) -> str:
    """The database as a person recognises it: the SQLite file, or the URL without a password."""
    if not settings.database_url:
        return str((settings.data_dir / "rayeval.db").resolve())
    from sqlalchemy.engine import make_url

    try:
        return make_url(settings.database_url).render_as_string(hide_password=True)
    except ValueError:
        return "given by --database-url"


def _act(store: Any, args: argparse.Namespace) -> int:
    accounts = store.accounts
    actor = f"{getpass.getuser()} (cli)"
    command = args.users_command
    if command == "add":
        user, key = accounts.add_user(
            args.name,
            args.role,
            1.0 if args.weight is None else args.weight,
            args.max_ranks,
            actor=actor,
        )
        _print_key(user.name, key)
    elif command == "list":
        _print_users(accounts)
    elif command == "set":
        user = accounts.update_user(
            args.name, args.role, args.weight, args.max_ranks, args.no_cap, actor=actor
        )
        print(_line(user))
    elif command == "rotate":
        _print_key(args.name, accounts.rotate(args.name, actor=actor))
    else:
        revoked = accounts.revoke(args.name, args.key, actor=actor)
        print(f"revoked {len(revoked)} key(s) of {args.name}: {', '.join(revoked) or 'none live'}")
    return 0


def _print_key(name: str, key: str) -> None:
    print(f"API key of {name} (shown once; the server keeps only its hash):")
    print(key)


def _print_users(accounts: Any) -> None:
    keys = accounts.keys()
    for user in accounts.users():
        print(_line(user))
        for key in (k for k in keys if k.user == user.name):
            state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "live"
            print(f"  key {key.id}  made {key.created_at:%Y-%m-%d %H:%M}  {state}")


def _line(user: Any) -> str:
    cap = f"{user.max_ranks} ranks" if user.max_ranks is not None else "no cap"
    return f"{user.name}  {user.role.value}  weight {user.weight:g}  {cap}"
