"""The store on both backends: SQLite (a file) and PostgreSQL (a real server, ``tests.postgres``).

Migrations create the newest schema on an empty database and migrate one written before they
existed (branch house's schema, ``tests/data/house_schema.sql``) without losing a row; the
migrated schema is exactly the models'. State changes stay exclusive under races, preemption
puts an evaluation back in the queue with its events kept, users' keys are stored as SHA-256
digests only (scrypt ones from before upgraded), and the audit trail reads back newest first.
Each test runs once per backend (the ``database_url`` fixture, parametrized by ``DATABASES``).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from rayeval.actors.errors import ConfigError
from rayeval.service.jobs import migrations
from rayeval.service.jobs.accounts import Role, secret_matches, split_key
from rayeval.service.jobs.audit import Action
from rayeval.service.jobs.store import EvaluationStore
from rayeval.service.vocabulary.errors import UserConflictError, UserNotFoundError
from rayeval.service.vocabulary.events import PreemptedEvent
from rayeval.service.vocabulary.states import EvaluationStatus as S
from rayeval.service.vocabulary.states import EventKind
from tests.postgres import DATABASES

#: The smallest stored configuration (a store test needs only that it parses).
CONFIG_JSON = {"model_args": {"pretrained": "m"}, "tasks": ["t"]}

HOUSE_DUMP = Path(__file__).parent / "data" / "house_schema.sql"
both = pytest.mark.parametrize("database_url", DATABASES, indirect=True)


def _store(url: str) -> EvaluationStore:
    store = EvaluationStore(url)
    store.create_schema()
    return store


@both
def test_migrations_build_exactly_the_models_schema(database_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from rayeval.service.jobs.rows import Base

    store = _store(database_url)
    store.create_schema()  # idempotent
    assert migrations.current(store._engine) == migrations.head()
    with store._engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    store.close()


@pytest.mark.unit
def test_a_database_from_before_migrations_keeps_every_row(tmp_path: Path) -> None:
    """The SQLite file of branch house's schema: stamped as the baseline, migrated, every
    evaluation, event, result and sample still there, owned by the built-in admin."""
    path = tmp_path / "house.db"
    with sqlite3.connect(path) as connection:
        connection.executescript(HOUSE_DUMP.read_text())
    counts_before = _counts(f"sqlite:///{path}")
    store = _store(f"sqlite:///{path}")
    assert migrations.current(store._engine) == migrations.head()
    assert _counts(f"sqlite:///{path}") == counts_before
    records, total = store.page(oldest_first=True)
    assert total == 2 and [r.owner for r in records] == ["admin", "admin"]
    done, queued = records
    assert (done.status, queued.status) == (S.SUCCEEDED, S.QUEUED)
    assert store.results_json(done.id) == (
        '{"results": {"demo_mc": {"acc,none": 0.5}}}',
        {"loglikelihood": {"requests": 4}},
    )
    assert store.samples_jsonl(done.id, "demo_mc") == '{"doc_id": 0}\n'
    states = [e.data["status"] for e in store.events_since(done.id, 0) if e.type is EventKind.STATE]
    assert states == ["queued", "starting", "running", "succeeded"]
    # New writes work on the migrated file: the next event is numbered after the old ones.
    assert store.transition(queued.id, S.STARTING)
    assert [e.seq for e in store.events_since(queued.id, 0)] == [1, 2]
    assert store.create(CONFIG_JSON, {"CPU": 1.0}, owner="bob").number == 3
    store.close()


def _counts(url: str) -> dict[str, int]:
    store = EvaluationStore(url)
    tables = ("evaluations", "evaluation_events", "evaluation_results", "evaluation_samples")
    with store._engine.connect() as connection:
        counts = {
            t: connection.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables
        }
    store.close()
    return counts


@both
def test_state_changes_are_exclusive_and_events_numbered(database_url: str) -> None:
    """A cancel racing a completion and a progress report: exactly one of the two state changes
    wins, results exist only if completion won, and event numbers stay 1, 2, 3, ..."""
    store = _store(database_url)
    for _ in range(5):
        record = store.create(CONFIG_JSON, {"CPU": 1.0})
        assert store.transition(record.id, S.STARTING)
        assert sorted(_race(store, record.id)) == [False, True]
        final = store.get(record.id)
        assert final.status in {S.CANCELLED, S.SUCCEEDED}
        assert (store.results_json(record.id) is not None) == (final.status is S.SUCCEEDED)
        events = store.events_since(record.id, 0)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].data["status"] == final.status.value
    store.close()


def _race(store: EvaluationStore, record_id: str) -> list[bool]:
    barrier = threading.Barrier(3)
    outcomes: list[bool] = []
    calls: list[Callable[[], Any]] = [
        lambda: outcomes.append(store.transition(record_id, S.CANCELLED)),
        lambda: outcomes.append(store.finish_succeeded(record_id, "{}", {"t": "{}\n"}, {}, [])),
        lambda: store.record_progress(
            record_id, {"phases": {}}, 1, [(EventKind.PROGRESS, {"done": 1})]
        ),
    ]

    def run(call: Callable[[], Any]) -> None:
        barrier.wait(timeout=30)
        call()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


@both
def test_preempted_evaluations_queue_again_with_their_events(database_url: str) -> None:
    store = _store(database_url)
    record = store.create(CONFIG_JSON, {"CPU": 2.0}, owner="carol")
    assert store.transition(record.id, S.STARTING) and store.transition(record.id, S.RUNNING)
    assert store.record_progress(record.id, {"phases": {}}, 7)
    assert store.requeue(record.id, PreemptedEvent(by="urgent", done=12))
    again = store.get(record.id)
    assert (again.status, again.runner_cursor, again.started_at) == (S.QUEUED, 0, None)
    assert not store.requeue(record.id, PreemptedEvent(by="urgent", done=0)), "queued already"
    kinds = [
        (e.type, e.data.get("status") or e.data.get("by")) for e in store.events_since(record.id, 0)
    ]
    assert kinds[-2:] == [(EventKind.PREEMPTED, "urgent"), (EventKind.STATE, "queued")]
    assert store.transition(record.id, S.STARTING), "it starts again like any queued one"
    assert [r.id for r in store.page(owner="carol")[0]] == [record.id]
    assert store.page(owner="dave") == ([], 0)
    store.close()


@both
def test_a_key_stored_as_scrypt_still_proves_itself_and_is_upgraded(database_url: str) -> None:
    store = _store(database_url)
    _, key = store.accounts.add_user("alice", "member")
    key_id, secret = split_key(key) or ("", "")
    salt = bytes(16)
    legacy = hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)
    old = f"scrypt${2**14}$8$1${salt.hex()}${legacy.hex()}"
    with store._engine.begin() as connection:
        connection.execute(text("UPDATE api_keys SET hash = :h"), {"h": old})
    assert secret_matches(secret, old) and not secret_matches(secret + "x", old)
    store.accounts.upgrade_hash(key_id, secret)
    upgraded = store.accounts.holder(key_id)
    assert upgraded is not None and upgraded[1].startswith("sha256$")
    assert secret_matches(secret, upgraded[1])


@both
def test_users_keys_are_hashed_rotated_and_revoked(database_url: str) -> None:
    store = _store(database_url)
    accounts = store.accounts
    user, key = accounts.add_user("alice", "member", weight=2.0, max_ranks=4)
    assert (user.role, user.weight, user.max_ranks) == (Role.MEMBER, 2.0, 4)
    key_id, secret = split_key(key) or ("", "")
    with store._engine.connect() as connection:
        stored = connection.execute(text("SELECT hash FROM api_keys")).scalar_one()
    assert secret not in stored and stored.startswith("sha256$")
    holder = accounts.holder(key_id)
    assert holder is not None and holder[0].name == "alice" and secret_matches(secret, holder[1])
    assert not secret_matches(secret + "x", holder[1])

    new_key = accounts.rotate("alice")
    assert accounts.holder(key_id) is None, "rotating revokes the old key"
    new_id = (split_key(new_key) or ("", ""))[0]
    assert accounts.holder(new_id) is not None
    assert accounts.revoke("alice", new_id) == [new_id] and accounts.holder(new_id) is None
    assert [k.revoked_at is not None for k in accounts.keys("alice")] == [True, True]
    assert accounts.update_user("alice", clear_cap=True, weight=3.0).max_ranks is None
    assert accounts.shares()["alice"].weight == 3.0

    with pytest.raises(UserConflictError, match="rayeval users rotate alice"):
        accounts.add_user("alice", "viewer")
    with pytest.raises(UserNotFoundError, match="rayeval users add bob"):
        accounts.rotate("bob")
    with pytest.raises(UserNotFoundError, match="no live key"):
        accounts.revoke("alice", "nope")
    with pytest.raises(ConfigError) as refused:
        accounts.add_user("Bad Name", "owner", weight=0, max_ranks=0)
    for field in ("name:", "role:", "weight:", "max_ranks:"):
        assert field in str(refused.value)
    with pytest.raises(ConfigError, match="--api-token"):
        accounts.add_user("admin", "admin")
    store.close()


@both
def test_the_audit_trail_reads_newest_first(database_url: str) -> None:
    store = _store(database_url)
    store.audit.record("alice", Action.SUBMIT, "e1", {"tasks": ["demo_mc"]})
    store.audit.record("root (cli)", Action.USER_ADD, "alice", {"role": "member"})
    store.audit.record("alice", Action.CANCEL, "e1")
    entries, total = store.audit.page()
    assert total == 3 and [e.action for e in entries] == [
        Action.CANCEL,
        Action.USER_ADD,
        Action.SUBMIT,
    ]
    assert entries[2].detail == {"tasks": ["demo_mc"]} and entries[0].at >= entries[2].at
    mine, count = store.audit.page(actor="alice", action=Action.SUBMIT)
    assert count == 1 and mine[0].target == "e1"
    store.close()


@both
def test_a_sweep_s_checkpoints_keep_their_order_and_results(database_url: str) -> None:
    """Checkpoints are stored with the progress that carries them, listed in the order they
    first ended; a later report replaces an earlier one, but a ``skipped`` one never replaces
    stored results."""
    from rayeval.service.vocabulary.events import CheckpointOutputs, EvaluationProgress

    store = _store(database_url)
    record = store.create(CONFIG_JSON, {"CPU": 1.0})
    store.transition(record.id, S.STARTING)

    def report(label: str, status: str, results: str | None = None, **samples: str) -> Any:
        data = {"label": label, "step": int(label[5:]), "status": status}
        return CheckpointOutputs(record=data, results_json=results, samples=samples)

    progress = EvaluationProgress()
    store.record_progress(record.id, progress, 1, (), [report("step-2", "succeeded", "{2}", t="x")])
    store.record_progress(record.id, progress, 2, (), [report("step-1", "failed")])
    again = [report("step-2", "skipped"), report("step-1", "succeeded", "{1}")]
    store.record_progress(record.id, progress, 3, (), again)
    stored = store.sweeps.checkpoints(record.id)
    assert [(c.record["label"], c.record["status"], c.has_results) for c in stored] == [
        ("step-2", "succeeded", True),
        ("step-1", "succeeded", True),
    ]
    assert stored[0].sample_tasks == ["t"]
    assert store.sweeps.results_json(record.id, "step-2") == "{2}"
    assert store.sweeps.samples_jsonl(record.id, "step-2", "t") == "x"
    assert store.sweeps.results_json(record.id, "step-9") is None
    assert store.sweeps.checkpoints("unknown") == []
