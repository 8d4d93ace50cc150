"""``rayeval users``: on the server's database directly (a SQLite file here), keys printed once,
mistakes refused with exit status 2 and a message naming the field and the fix."""

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
    ("argv", "words"),
    [
        (["set", "nobody", "--weight", "2"], "no user 'nobody'"),
        (["rotate", "nobody"], "rayeval users add nobody"),
        (["add", "erin", "--role", "member", "--weight", "0"], "weight: 0.0 is out of range"),
        (["add", "erin", "--role", "member", "--max-ranks", "0"], "max_ranks: 0 is out of range"),
        (["add", "Erin!", "--role", "member"], "name: 'Erin!' is not a user name"),
        (["add", "admin", "--role", "admin"], "--api-token"),
    ],
)
def test_mistakes_exit_2_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    status, _, err = _users(capsys, tmp_path, *argv)
    assert status == 2 and err.startswith(f"rayeval users {argv[0]}: error:") and words in err
