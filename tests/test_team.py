"""A service a team shares, end to end on PostgreSQL: keys and roles, fair admission, preemption
without loss, a database restart mid-run, the audit trail and the dashboard signed in as a member.

One server (``ServerThread`` of ``tests/test_service.py``) keeps its data in a database on the
session's real PostgreSQL server (``tests/postgres.py``); runners and ranks are real Ray actors on
the session's 4-CPU cluster. These heavy scenarios run once, on PostgreSQL; the store's own tests
run on both backends (``tests/test_store.py``).
"""

from __future__ import annotations

import getpass
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres import PostgresServer
from tests.test_service import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    ServerThread,
    body,
    finished,
    make_settings,
    read_events,
)

ADMIN_TOKEN = "team-admin-token"


@pytest.fixture(scope="module")
def team_db(postgres: PostgresServer) -> str:
    return postgres.create_database()


@pytest.fixture(scope="module")
def team(
    demo: Any, ray_session: None, team_db: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    data_dir = tmp_path_factory.mktemp("team-data")
    settings = make_settings(
        data_dir, demo.tasks_dir, database_url=team_db, api_token=ADMIN_TOKEN, require_api_keys=True
    )
    handle = ServerThread(settings)
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def keys(team: ServerThread, team_db: str) -> dict[str, str]:
    """alice and bob (members, by REST), vera (a viewer, by the CLI on the database)."""
    made = {}
    with team.client(ADMIN_TOKEN) as admin:
        for name in ("alice", "bob"):
            response = admin.post("/users", json={"name": name, "role": "member"})
            assert response.status_code == 201, response.text
            made[name] = response.json()["key"]
        capped = admin.post("/users", json={"name": "capped", "role": "member", "max_ranks": 2})
        made["capped"] = capped.json()["key"]
    done = subprocess.run(
        [sys.executable, "-m", "rayeval.api.cli", "users", "add", "vera", "--role", "viewer",
         "--database-url", team_db],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "shown once" in done.stdout
    made["vera"] = done.stdout.strip().splitlines()[-1]
    return made


def small(demo: Any, **overrides: Any) -> dict[str, Any]:
    """A short evaluation: one task, two documents, one rank."""
    defaults = {
        "tasks": ["demo_mc"],
        "limit": 2,
        "log_samples": True,
        "parallelism": {"num_replicas": 1, "shard_size": 1},
    }
    return body(demo, **{**defaults, **overrides})


def submit_as(client: httpx.Client, payload: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/evaluations", json=payload)
    assert response.status_code == 202, response.text
    return dict(response.json())


def wait_until(
    client: httpx.Client,
    evaluation_id: str,
    done: Callable[[dict[str, Any]], bool],
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Poll until ``done`` holds; answers other than 200 (a database restarting) are retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.get(f"/evaluations/{evaluation_id}")
        if response.status_code == 200 and done(evaluation := response.json()):
            return dict(evaluation)
        assert response.status_code in (200, 503), response.text
        assert time.monotonic() < deadline, f"timed out; last answer: {response.text}"
        time.sleep(0.2)


# --------------------------------------------------------------------- keys and roles
@pytest.mark.service
def test_members_see_and_act_on_their_own_only(
    team: ServerThread, keys: dict[str, str], demo: Any
) -> None:
    with (
        team.client(keys["alice"]) as alice,
        team.client(keys["bob"]) as bob,
        team.client(keys["vera"]) as vera,
        team.client(ADMIN_TOKEN) as admin,
    ):
        assert alice.get("/me").json() == {"name": "alice", "role": "member"}
        mine = submit_as(alice, small(demo))
        theirs = submit_as(bob, small(demo))
        assert (mine["owner"], theirs["owner"]) == ("alice", "bob")

        listed = {e["id"] for e in alice.get("/evaluations").json()["items"]}
        assert mine["id"] in listed and theirs["id"] not in listed
        unknown = alice.get("/evaluations/nope").json()["detail"].replace("nope", theirs["id"])
        base = f"/evaluations/{theirs['id']}"
        for method, path in [
            ("GET", base), ("GET", base + "/events"), ("GET", base + "/results"),
            ("GET", base + "/samples/demo_mc"), ("GET", base + "/timeline"),
            ("DELETE", base), ("POST", base + "/retry"),
        ]:  # fmt: skip
            response = alice.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["detail"] == unknown, "no existence oracle"

        seen = {e["id"] for e in vera.get("/evaluations").json()["items"]}
        assert {mine["id"], theirs["id"]} <= seen
        assert vera.get(base).status_code == 200 and vera.get("/metrics").status_code == 200
        refused = vera.post("/evaluations", json=small(demo))
        assert refused.status_code == 403 and "viewers read" in refused.json()["detail"]
        assert vera.delete(f"/evaluations/{mine['id']}").status_code == 403
        assert alice.get("/metrics").status_code == 403
        assert alice.get("/audit").status_code == 403

        assert bob.delete(base).status_code in (200, 409)  # cancelled, or it had already ended
        wait_until(bob, theirs["id"], finished)
        retried = admin.post(base + "/retry")
        assert retried.status_code == 202 and retried.json()["owner"] == "bob"
        admin.delete(f"/evaluations/{retried.json()['id']}")
        final = wait_until(alice, mine["id"], finished)
        assert final["status"] == "succeeded", final["error"]
        assert alice.get(f"/evaluations/{mine['id']}/results").status_code == 200


@pytest.mark.service
def test_bad_input_to_users_and_keys_is_a_4xx_naming_the_fix(
    team: ServerThread, keys: dict[str, str], demo: Any
) -> None:
    with team.client(ADMIN_TOKEN) as admin, team.client(keys["capped"]) as capped:
        member = {"role": "member"}
        cases = [
            (admin.post("/users", json={"name": "w", **member, "weight": 0}), 422, "weight"),
            (admin.post("/users", json={"name": "r", "role": "owner"}), 422, "role"),
            (admin.post("/users", json={"name": "Bad Name", **member}), 422, "name"),
            (admin.post("/users", json={"name": "m", **member, "max_ranks": 0}), 422, "max_ranks"),
            (admin.post("/users", json={"name": "alice", **member}), 409, "rotate"),
            (admin.patch("/users/nobody", json={"weight": 2}), 404, "rayeval users add"),
            (admin.delete("/users/alice/keys/nokey"), 404, "no live key"),
            (admin.post("/evaluations", json=small(demo, scheduling={"priority": "high"})), 422,
             "scheduling.priority"),
            (capped.post("/evaluations", json=small(demo, parallelism={"num_replicas": 3})), 422,
             "cap is 2 ranks"),
        ]  # fmt: skip
        for response, code, words in cases:
            assert response.status_code == code, response.text
            assert words in response.json()["detail"], response.text

        old = keys["capped"]
        rotated = admin.post("/users/capped/keys")
        assert rotated.status_code == 200
        with team.client(old) as stale, team.client(rotated.json()["key"]) as fresh:
            response = stale.get("/evaluations")
            assert response.status_code == 401 and "revoked" in response.json()["detail"]
            assert fresh.get("/me").json()["name"] == "capped"
        with team.client("rk_nope_nope") as unknown, team.client() as nobody:
            assert unknown.get("/evaluations").status_code == 401
            assert nobody.get("/evaluations").status_code == 401, "--require-api-keys"


@pytest.mark.service
def test_mistakes_are_caught_at_submission(
    team: ServerThread, keys: dict[str, str], demo: Any
) -> None:
    """What a new user gets wrong is a 422 naming the field and the fix, never a 202 that fails
    when its turn comes in a shared queue."""
    model = str(demo.model_dir)
    cases = [
        ({"model_args": {"pretrained": model, "dtype": {}}}, "model_args.dtype: {} is not a dtype"),
        ({"model_args": {"pretrained": model, "dtype": None}}, "model_args.dtype: None"),
        ({"model_args": {"pretrained": model, "dtype": "fp17"}}, "model_args.dtype: 'fp17'"),
        ({"bootstrap_iters": 1}, "bootstrap_iters: 1 iteration cannot give a standard error"),
        ({"tasks": ["*"]}, "tasks: '*' matches the groups or tags"),
        ({"apply_chat_template": True}, "apply_chat_template: the tokenizer at"),
    ]
    with team.client(keys["alice"]) as alice:
        for change, words in cases:
            response = alice.post("/evaluations", json=small(demo, **change))
            assert response.status_code == 422, (change, response.text)
            assert words in response.json()["detail"], response.text


# ------------------------------------------------------------------ fair admission
@pytest.mark.service
def test_one_users_queue_does_not_hold_another_behind_it(
    team: ServerThread, keys: dict[str, str], demo: Any
) -> None:
    """alice's 4-rank evaluation fills the 4-CPU cluster and her two 2-rank ones wait; bob's one,
    submitted after them, starts beside her first one of them (each user in turn, oldest first
    on a tie), her second waits for room; each starts exactly once."""
    whole = small(demo, parallelism={"num_replicas": 4, "shard_size": 1}, log_samples=False)
    two = small(demo, parallelism={"num_replicas": 2, "shard_size": 1}, log_samples=False)
    with team.client(keys["alice"]) as alice, team.client(keys["bob"]) as bob:
        a1 = submit_as(alice, whole)
        a2, a3 = submit_as(alice, two), submit_as(alice, two)
        b1 = submit_as(bob, two)
        # While alice holds the whole cluster, bob's one is next; once she holds nothing, it is
        # a tie and her older one goes first, bob's beside it.
        waiting = wait_until(
            bob, b1["id"], lambda e: e["queue_position"] == 1 or e["status"] != "queued", 60
        )
        if waiting["status"] == "queued":
            assert alice.get(f"/evaluations/{a3['id']}").json()["queue_position"] == 3
        ends = {e["id"]: wait_until(alice, e["id"], finished) for e in (a1, a2, a3)}
        ends[b1["id"]] = wait_until(bob, b1["id"], finished)
    assert all(e["status"] == "succeeded" for e in ends.values()), ends
    start = {i: datetime.fromisoformat(e["started_at"]) for i, e in ends.items()}
    end = {i: datetime.fromisoformat(e["finished_at"]) for i, e in ends.items()}
    assert start[b1["id"]] < start[a3["id"]], "bob's one before alice's third"
    assert start[a3["id"]] >= min(end[a2["id"]], end[b1["id"]]), "alice's third waited for room"
    for evaluation in (a1, a2, a3, b1):
        events = read_events(team.url, f"/evaluations/{evaluation['id']}/events", _auth())
        states = [e["data"]["status"] for e in events if e["event"] == "state"]
        assert states.count("starting") == 1 and states[-1] == "succeeded", "run exactly once"


def _auth(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ------------------------------------------------------------ preemption without loss
@pytest.mark.service
def test_a_preemptible_evaluation_gives_way_and_loses_nothing(
    team: ServerThread, keys: dict[str, str], demo: Any
) -> None:
    """A slow preemptible 2-rank evaluation is stopped for an urgent 3-rank one, goes back to
    the queue, and when it runs again the response cache answers everything it had finished:
    every request computed once."""
    long_run = body(
        demo,
        tasks=["demo_gen_short", "demo_gen_long"],  # 20 + 15 documents
        limit=None,
        num_fewshot=1,
        gen_kwargs={"until": ["<never>"], "max_gen_toks": 96},  # long answers: a slow run
        continuous_batching=False,
        batch_size=1,
        log_samples=False,
        # FSDP over two ranks decodes several times slower than one rank: time to preempt it
        # mid-run, whatever the lag of its progress reports.
        parallelism={"num_replicas": 1, "shard_size": 2, "shard_strategy": "fsdp"},
        scheduling={"preemptible": True},
    )
    urgent = small(demo, parallelism={"num_replicas": 3}, scheduling={"priority": 10})
    with team.client(keys["alice"]) as alice, team.client(keys["bob"]) as bob:
        victim = submit_as(alice, long_run)
        wait_until(alice, victim["id"], lambda e: e["progress"]["done"] >= 1 or finished(e), 240)
        head = submit_as(bob, urgent)
        assert wait_until(bob, head["id"], finished, 300)["status"] == "succeeded"
        final = wait_until(alice, victim["id"], finished, 600)
    assert final["status"] == "succeeded", final["error"]
    events = read_events(team.url, f"/evaluations/{victim['id']}/events", _auth())
    states = [e["data"]["status"] for e in events if e["event"] == "state"]
    summary = [(e["event"], e["data"].get("status") or e["data"].get("done")) for e in events]
    assert states == [
        "queued",
        "starting",
        "running",
        "queued",
        "starting",
        "running",
        "succeeded",
    ], summary
    (preempted,) = [e["data"] for e in events if e["event"] == "preempted"]
    assert preempted["by"] == head["id"] and 1 <= preempted["done"] < 35, preempted
    cached = sum(phase["cached"] for phase in final["stats"].values())
    computed = sum(phase["requests"] for phase in final["stats"].values())
    assert cached >= preempted["done"], (cached, preempted)
    assert cached + computed == 35, "every request once: computed or from the cache"
    after = events[[e["event"] for e in events].index("preempted") :]
    assert any(e["event"] == "progress" and e["data"]["cached"] > 0 for e in after)
    with team.client(ADMIN_TOKEN) as admin:
        trail = admin.get("/audit", params={"action": "preempt"}).json()["items"]
    assert [(t["actor"], t["target"], t["detail"]) for t in trail] == [
        ("scheduler", victim["id"], {"by": head["id"]})
    ]


# ------------------------------------------------------------------- database restart
@pytest.mark.service
def test_a_database_restart_mid_run_loses_nothing(
    team: ServerThread, keys: dict[str, str], demo: Any, postgres: PostgresServer
) -> None:
    """PostgreSQL stops and starts while an evaluation runs: the service reconnects, the
    evaluation finishes, and its event stream has every event, numbered 1, 2, 3, ..."""
    run = body(
        demo,
        tasks=["demo_cloze"],
        limit=24,
        num_fewshot=1,
        batch_size=1,
        log_samples=False,
        parallelism={"num_replicas": 1, "shard_size": 1},
    )
    with team.client(keys["alice"]) as alice:
        evaluation = submit_as(alice, run)
        before = wait_until(
            alice, evaluation["id"], lambda e: e["progress"]["done"] >= 4 or finished(e)
        )
        assert before["status"] == "running", before
        postgres.stop()
        time.sleep(3.0)
        down = alice.get(f"/evaluations/{evaluation['id']}/results")
        assert down.status_code in (503, 409), down.text
        postgres.start()
        final = wait_until(alice, evaluation["id"], finished, 300)
    assert final["status"] == "succeeded", final["error"]
    events = read_events(team.url, f"/evaluations/{evaluation['id']}/events", _auth())
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    states = [e["data"]["status"] for e in events if e["event"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    done = [e["data"]["done"] for e in events if e["event"] == "progress"]
    assert done == sorted(done) and done[-1] == final["progress"]["total"] == 24
    assert final["stats"]["loglikelihood"]["requests"] == 24


# ------------------------------------------------------------------ audit and dashboard
@pytest.mark.service
def test_the_audit_trail_names_who_did_what(
    team: ServerThread, keys: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from rayeval.api.cli import main

    assert main(["audit", "--url", team.url, "--token", ADMIN_TOKEN, "--limit", "200"]) == 0
    out = capsys.readouterr().out
    shell = f"{getpass.getuser()} (cli)"
    for actor, action in [
        ("admin", "user.add"), (shell, "user.add"), ("alice", "submit"), ("bob", "cancel"),
        ("admin", "retry"), ("admin", "key.rotate"),
    ]:  # fmt: skip
        assert any(actor in line and action in line for line in out.splitlines()), (actor, action)
    assert main(["audit", "--url", team.url, "--token", keys["bob"]]) == 1  # the server's 403
    assert "403" in capsys.readouterr().err


@pytest.mark.e2e
def test_dashboard_signs_in_as_a_member_and_shows_only_theirs(
    team: ServerThread, keys: dict[str, str]
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    with team.client(ADMIN_TOKEN) as admin:
        everything = admin.get("/evaluations", params={"limit": 200}).json()["items"]
    bobs = {e["id"] for e in everything if e["owner"] == "bob"}
    assert bobs and len(bobs) < len(everything)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(team.url + "/")
            page.locator("#auth").wait_for(state="visible", timeout=30_000)
            page.fill("#token", keys["bob"])
            page.click("#auth button[type=submit]")
            page.locator("#whoami", has_text="signed in as bob (member)").wait_for(timeout=30_000)
            page.locator("#evaluations tbody tr").first.wait_for(timeout=30_000)
            page.wait_for_timeout(2500)  # one more refresh of the list
            shown = set(
                page.eval_on_selector_all(
                    "#evaluations tbody tr", "rows => rows.map(r => r.dataset.id)"
                )
            )
            owners = set(
                page.eval_on_selector_all(
                    "#evaluations td.owner", "cells => cells.map(c => c.textContent)"
                )
            )
            assert shown == bobs and owners == {"bob"}
            assert "rk_" not in page.url, "the key is never in a URL"
        finally:
            browser.close()
