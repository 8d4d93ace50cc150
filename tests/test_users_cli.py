"""``rayeval users``: on the server's database directly (a SQLite file here; by default the one
``make run`` serves), named on every use; keys printed once; bad input refused with exit status 2,
an unknown or taken name with 1, each with a message naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayeval.api.cli import main
from rayeval.service.jobs.accounts import split_key
from rayeval.service.jobs.store import EvaluationStore

pytestmark = pytest.mark.unit


def _users(capsys: pytest.CaptureFixture[str], data_dir: Path, *argv: str) -> tuple[int, str, str]:
    status = main(["users", *argv, "--data-dir", str(data_dir)])
    out, err = capsys.readouterr()
    return status, out, err


def test_add_list_set_rotate_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _users(capsys, tmp_path, "add", "dana", "--role", "member", "--max-ranks", "4")
    assert status == 0 and "shown once" in out
    key = out.strip().splitlines()[-1]
    key_id = (split_key(key) or ("", ""))[0]
    store = EvaluationStore(f"sqlite:///{tmp_path / 'rayeval.db'}")
    holder = store.accounts.holder(key_id)
    assert holder is not None and holder[0].name == "dana"

    status, out, _ = _users(capsys, tmp_path, "set", "dana", "--weight", "3", "--no-cap")
    assert status == 0 and out.strip() == "dana  member  weight 3  no cap"
    status, out, _ = _users(capsys, tmp_path, "rotate", "dana")
    assert status == 0 and store.accounts.holder(key_id) is None
    new_id = (split_key(out.strip().splitlines()[-1]) or ("", ""))[0]
    status, out, _ = _users(capsys, tmp_path, "revoke", "dana", "--key", new_id)
    assert status == 0 and new_id in out and store.accounts.holder(new_id) is None
    status, out, _ = _users(capsys, tmp_path, "list")
    assert status == 0 and out.count("revoked") == 2 and key not in out
    trail = [entry.action.value for entry in store.audit.page()[0]]
    assert trail == ["key.revoke", "key.rotate", "user.update", "user.add"]
    assert all(entry.actor.endswith("(cli)") for entry in store.audit.page()[0])
    store.close()


@pytest.mark.parametrize(
    ("argv", "words", "expected"),
    [
        (["set", "nobody", "--weight", "2"], "no user 'nobody'", 1),
        (["rotate", "nobody"], "rayeval users add nobody", 1),
        (["add", "erin", "--role", "member", "--weight", "0"], "weight: 0.0 is out of range", 2),
        (
            ["add", "erin", "--role", "member", "--max-ranks", "0"],
            "max_ranks: 0 is out of range",
            2,
        ),
        (["add", "Erin!", "--role", "member"], "name: 'Erin!' is not a user name", 2),
        (["add", "admin", "--role", "admin"], "--api-token", 2),
    ],
)
def test_mistakes_exit_2_and_refusals_1_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str, expected: int
) -> None:
    _users(capsys, tmp_path, "add", "dana", "--role", "member")  # the database exists
    status, _, err = _users(capsys, tmp_path, *argv)
    said = err.splitlines()[-1]
    assert status == expected and said.startswith(f"rayeval users {argv[0]}: error:"), err
    assert words in said


def test_the_database_is_named_and_defaults_to_the_one_make_run_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rayeval serve`'s default data dir, .rayeval/service (what `make run` passes), or
    RAYEVAL_DATA_DIR; only `add` makes a database that is not there, saying so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYEVAL_DATA_DIR", raising=False)
    monkeypatch.delenv("RAYEVAL_DATABASE_URL", raising=False)
    default = (tmp_path / ".rayeval" / "service" / "rayeval.db").resolve()
    assert main(["users", "list"]) == 2
    err = capsys.readouterr().err
    assert f"no database at {default}" in err and "--data-dir" in err and "make run" in err
    assert not default.exists()  # nothing made by a look
    assert main(["users", "add", "ana", "--role", "admin"]) == 0
    err = capsys.readouterr().err
    assert f"rayeval users: database {default}, new: `rayeval serve --data-dir" in err
    assert default.is_file()
    assert main(["users", "list"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"rayeval users: database {default}" and out.startswith("ana  admin")
    monkeypatch.setenv("RAYEVAL_DATA_DIR", str(tmp_path / "elsewhere"))
    assert main(["users", "list"]) == 2
    assert f"no database at {(tmp_path / 'elsewhere' / 'rayeval.db').resolve()}" in (
        capsys.readouterr().err
    )
