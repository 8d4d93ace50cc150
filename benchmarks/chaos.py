"""Nothing lost under chaos: a seeded fault-injection soak of the whole service (issue 41).

A team's load on a real service while an injector breaks one thing at a time, then a check that
nothing was lost, nothing was wrong and nothing was left behind.

The service: ``rayeval serve`` (``service_harness.start_server``) on a Ray cluster of a head and
two worker nodes (``ray.cluster_utils.Cluster``, owned by this process, so the API server can
restart on it), its store on a throw-away PostgreSQL cluster (``tests/postgres.py``; SQLite under
the data folder, with a note, where PostgreSQL is not installed), warm replicas on, the response
cache on a small tmpfs (so the disk can be filled; without ``mount`` the disk fault is skipped
with a note). Three users (members, their own keys) keep two evaluations each in flight, picked by
the seed from the recipes below (multiple choice, rolling loglikelihood, generation with
continuous batching, greedy and sampled (never cached, so ranks compute all through the soak), a
preemptible cloze and an urgent one that may preempt it, and a checkpoint sweep over two DCP
checkpoints of the model saved beside the data, its ranks started once and the weights swapped).

1. A quiet pass: each recipe once on a server without the response cache; its per-sample results
   are the reference.
2. The soak (``--minutes``; ``--short``: about two minutes of faults, one of each kind in a
   seeded order): the users' load, a poller reading ``GET /evaluations/{id}`` every 0.2 s on a
   kept-alive connection, as a dashboard does (its latency is the status p99; every fifth read
   goes on a new client instead, as a one-off ``httpx.get`` does, and is reported apart; the
   quiet pass's own reads are the machine's baseline), and the injector, which at seeded random
   times (starts 13 s apart on average, whatever each fault lasts) does one of
   ``rank`` (SIGKILL of a rank process), ``runner`` (``ray.kill`` of a runner actor), ``node``
   (``cluster.remove_node`` of a worker, then a fresh one joins), ``api`` (the API server stopped
   and started on the same store and port), ``postgres`` (the database stopped for three seconds),
   ``stream`` (a client's event stream of a running evaluation dropped after a few events and
   followed again with ``Last-Event-ID``) and ``disk`` (the response cache's filesystem filled to
   the last byte for eight seconds).
3. The checks: every evaluation in the store reached a terminal state (else *lost*); every
   succeeded one's samples equal the quiet pass's for its recipe (a sweep's, per checkpoint)
   (else *wrong*); no answer was computed twice (the response cache counts the answers stored
   that it held already: each evaluation's ``recomputed``, a sweep's summed over its
   checkpoints) except those in flight at a kill (the evaluation lost a replica then: its
   ``requeued``) or computed by two evaluations running at once (else *wrong*, see
   :func:`computed_twice`); every evaluation's events are numbered 1, 2, 3, ... and end in its
   final state, and every dropped-then-resumed stream read exactly the stored events (else
   *lost*); after the server stops, no rank or runner actor, rank process, placement group or
   ``rayeval-*`` temporary folder is left (else *left behind*).

Usage: ``python benchmarks/chaos.py [--minutes 10] [--short] [--seed 0] [--json out.json]
[--rank-niceness N]`` (the server's ``--rank-niceness``, to measure the status reads with the
ranks level with the control plane: 0).
Exit status 1 on any loss, wrong result or leftover; the last line reads
``chaos: N faults of K kinds, lost L, wrong W, left behind B``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_harness import (
    free_port,
    make_users,
    percentiles,
    start_server,
    stop_server,
    wait_ready,
)
from rayeval.service.result_files import parse_samples

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local throw-away cluster only
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

ADMIN = "chaos-admin"
USERS = 3
IN_FLIGHT = 2
TERMINAL = ("succeeded", "failed", "cancelled")
KINDS = ("rank", "runner", "node", "api", "postgres", "stream", "disk")
#: Seconds a fault lasts (the database down, the disk full) before it is repaired.
OUTAGE_S = {"postgres": 3.0, "disk": 8.0}
#: Seconds between the starts of two faults, on average, in a run of --minutes.
GAP_S = 13.0
#: Faults after which what was in flight is computed again: a rank, a runner, a node lost.
KILLS = ("rank", "runner", "node")
#: Seconds after an API server restart whose status reads are also reported apart.
AFTER_RESTART_S = 30.0
CACHE_TMPFS = "64m"


def recipes(model_dir: str, run_dir: Path) -> dict[str, dict[str, Any]]:
    """The evaluations the users pick from: name -> POST /evaluations body (``run_dir``: the
    sweep's checkpoints, :func:`make_checkpoints`)."""
    base = {
        "model_args": {"pretrained": model_dir, "dtype": "float32"},
        "bootstrap_iters": 0,
        "log_samples": True,
        "batch_size": 2,
        "parallelism": {"num_replicas": 1, "shard_size": 1},
    }
    return {
        "mc": {**base, "tasks": ["demo_mc"], "limit": 8},
        "rolling": {**base, "tasks": ["demo_rolling"], "limit": 4},
        "generation": {
            **base, "tasks": ["demo_gen_short"], "limit": 6, "continuous_batching": True,
        },
        # Sampled answers are never cached: this one computes on every run, so ranks load and
        # compute (and stay warm) all through the soak, whatever the cache holds by then.
        "sampled": {
            **base, "tasks": ["demo_gen_short"], "limit": 6, "continuous_batching": True,
            "gen_kwargs": {"do_sample": True, "temperature": 0.8},
        },
        "preemptible": {
            **base, "tasks": ["demo_cloze"], "limit": 12, "batch_size": 1,
            "parallelism": {"num_replicas": 2, "shard_size": 1},
            "scheduling": {"preemptible": True, "priority": -1},
        },
        "urgent": {**base, "tasks": ["demo_mc"], "limit": 4, "scheduling": {"priority": 5}},
        # The ranks start once and swap each checkpoint's weights in; its samples are per
        # checkpoint (GET /evaluations/{id}/sweep links them).
        "sweep": {
            **base, "tasks": ["demo_mc"], "limit": 6,
            "sweep": {"checkpoints": [str(run_dir / "step-*")]},
        },
    }  # fmt: skip


def make_checkpoints(model_dir: Path, run_dir: Path, count: int = 2) -> None:
    """``count`` DCP checkpoints of the demo model with seeded noise, as a training run saves
    them (``run_dir/step-100``, ...), for the sweep recipe."""
    import torch
    import transformers

    from benchmarks.bench_sweep import save_checkpoints

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_checkpoints(model, run_dir, count)


# ----------------------------------------------------------------------------- the service
@dataclass
class Service:
    """What the soak runs and breaks: the Ray cluster, the store, the API server, the disk."""

    assets: Any
    data_dir: Path
    cluster: Any
    database_url: str | None
    postgres: Any | None
    cache_mounted: bool
    port: int = field(default_factory=free_port)
    server: subprocess.Popen[bytes] | None = None
    response_cache: bool = True
    notes: list[str] = field(default_factory=list)
    #: The server's --rank-niceness (None: its default).
    rank_niceness: int | None = None
    #: Where the sweep's checkpoints are (another --model-root), if anywhere.
    run_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        extra = ["--ray-address", self.cluster.address, "--api-token", ADMIN]
        extra += ["--require-api-keys", "--warm-replicas", "2", "--poll-interval", "0.2"]
        extra += ["--sse-heartbeat", "1"]
        if self.rank_niceness is not None:
            extra += ["--rank-niceness", str(self.rank_niceness)]
        if self.run_dir is not None:
            extra += ["--model-root", str(self.run_dir)]
        if self.database_url:
            extra += ["--database-url", self.database_url]
        self.server = start_server(
            self.assets, self.data_dir, self.port, *extra, response_cache=self.response_cache
        )
        wait_ready(self.url)

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server)
            self.server = None


def start_service(assets: Any, root: Path) -> Service:
    """PostgreSQL (else SQLite), a tmpfs for the response cache, a three-node Ray cluster."""
    from ray.cluster_utils import Cluster

    notes = []
    postgres, database_url = _start_postgres(notes)
    data_dir = root / "data"
    cache = data_dir / "response-cache"
    cache.mkdir(parents=True)
    mounted = _mount_tmpfs(cache, notes)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    service = Service(assets, data_dir, cluster, database_url, postgres, mounted, notes=notes)
    return service


def _start_postgres(notes: list[str]) -> tuple[Any | None, str | None]:
    from tests.postgres import PostgresServer, find_binaries

    binaries = find_binaries()
    if binaries is None:
        notes.append("PostgreSQL is not installed: SQLite store, no database fault")
        return None, None
    server = PostgresServer(binaries)
    server.start()
    return server, server.create_database()


def _mount_tmpfs(folder: Path, notes: list[str]) -> bool:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={CACHE_TMPFS}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        notes.append(f"no tmpfs for the response cache ({done.stderr.strip()}): no disk fault")
        return False
    return True


def stop_service(service: Service) -> None:
    import ray

    service.stop()
    ray.shutdown()
    service.cluster.shutdown()
    if service.cache_mounted:
        subprocess.run(["umount", "-l", str(service.data_dir / "response-cache")], check=False)
    if service.postgres is not None:
        service.postgres.destroy()


# ------------------------------------------------------------------------------- the load
@dataclass
class Load:
    """The users' evaluations, the poller's latencies and what the injector recorded."""

    keys: dict[str, str]
    bodies: dict[str, dict[str, Any]]
    rng: random.Random
    submitted: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (user, recipe)
    latencies: list[float] = field(default_factory=list)
    #: When each of ``latencies`` was read (time.time()).
    read_at: list[float] = field(default_factory=list)
    #: Every fifth read's latency on a new client (connection and TLS context) instead.
    fresh_latencies: list[float] = field(default_factory=list)
    unavailable: int = 0
    #: Evaluations seen in a terminal state (not read again by the users and the injector).
    ended: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ids(self, user: str | None = None) -> list[str]:
        with self.lock:
            return [i for i, (u, _) in self.submitted.items() if user in (None, u)]

    def unended(self, user: str | None = None) -> list[str]:
        """The evaluations (of ``user``) not yet seen in a terminal state."""
        return [i for i in self.ids(user) if i not in self.ended]

    def status(self, url: str, evaluation_id: str) -> str | None:
        """An evaluation's status now (None while the server is away); a terminal one is
        remembered."""
        user = self.submitted[evaluation_id][0]
        response = _get(url, f"/evaluations/{evaluation_id}", self.keys[user])
        if response is None:
            return None
        status = str(response.json()["status"])
        if status in TERMINAL:
            with self.lock:
                self.ended.add(evaluation_id)
        return status


_CLIENTS = threading.local()


def _client() -> httpx.Client:
    """This thread's client: its connection is kept alive between requests, as a dashboard's or
    ``rayeval``'s own client keeps it. A new client per request (``httpx.get``) builds a TLS
    context first, about 50 ms of CPU even for plain HTTP: on a busy machine that, not the
    server, was most of a status read's latency."""
    client = getattr(_CLIENTS, "client", None)
    if client is None:
        client = _CLIENTS.client = httpx.Client(timeout=30)
    return client


def _get(
    url: str, path: str, key: str, fresh: bool = False, **params: Any
) -> httpx.Response | None:
    """A GET on this thread's kept-alive client (``fresh``: on a new client, as a one-off
    ``httpx.get`` does), or None while the server or its database is away."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if fresh:
            response = httpx.get(url + path, params=params, headers=headers, timeout=30)
        else:
            response = _client().get(url + path, params=params, headers=headers)
    except httpx.HTTPError:
        return None
    return None if response.status_code in (502, 503) else response


def user_loop(service: Service, load: Load, user: str) -> None:
    """Keep ``IN_FLIGHT`` evaluations of the user in flight until the soak stops."""
    key = load.keys[user]
    while not load.stop.is_set():
        live = 0
        for evaluation_id in load.unended(user):
            live += load.status(service.url, evaluation_id) not in TERMINAL
        if live < IN_FLIGHT:
            with load.lock:
                recipe = load.rng.choice(sorted(load.bodies))
            submitted = _submit(service.url, key, load.bodies[recipe])
            if submitted is not None:
                with load.lock:
                    load.submitted[submitted] = (user, recipe)
        load.stop.wait(1.0)


def _submit(url: str, key: str, body: dict[str, Any]) -> str | None:
    try:
        response = _client().post(
            f"{url}/evaluations", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    except httpx.HTTPError:
        return None  # an unanswered POST may still have stored it: the checks list the store
    if response.status_code != 202:
        return None
    return str(response.json()["id"])


def poller(service: Service, load: Load) -> None:
    """Read one evaluation's status every 0.2 s, on a kept-alive connection; keep the latency
    of each answered read (every fifth read on a new client, kept apart)."""
    turn = 0
    while not load.stop.is_set():
        ids = load.ids()
        if ids:
            evaluation_id = ids[turn % len(ids)]
            user = load.submitted[evaluation_id][0]
            fresh = turn % 5 == 4
            sent = time.perf_counter()
            response = _get(
                service.url, f"/evaluations/{evaluation_id}", load.keys[user], fresh=fresh
            )
            if response is not None and response.status_code == 200:
                (load.fresh_latencies if fresh else load.latencies).append(
                    time.perf_counter() - sent
                )
                if not fresh:
                    load.read_at.append(time.time())
            else:
                load.unavailable += 1
            turn += 1
        load.stop.wait(0.2)


# --------------------------------------------------------------------------- the injector
@dataclass
class Injector:
    """Breaks one thing at a time, at seeded random times; repairs what a fault leaves broken."""

    service: Service
    load: Load
    rng: random.Random
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    streams: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    followers: list[threading.Thread] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    #: (time.time() as it began, kind) of each fault injected.
    times: list[tuple[float, str]] = field(default_factory=list)
    #: Faults aimed at one evaluation (a rank, a runner, a stream), by its recipe.
    aimed: Counter[str] = field(default_factory=Counter)
    _target: str = ""

    def inject(self, kind: str) -> bool:
        """One fault of ``kind``; False when it had no target (nothing running to break)."""
        began = time.time()
        self._target = ""
        done = bool(getattr(self, f"_{kind}")())
        (self.faults if done else self.skipped)[kind] += 1
        if done:
            self.times.append((began, kind))
            if self._target:
                self.aimed[self._target] += 1
        aim = f" ({self._target})" if done and self._target else ""
        self.log.append(f"{time.strftime('%H:%M:%S')} {kind}{aim}{'' if done else ' (no target)'}")
        print(f"chaos: {self.log[-1]}", flush=True)
        return done

    def _alive(self, class_name: str) -> list[dict[str, Any]]:
        from ray._private import state as ray_state  # the GCS's table: no dashboard here

        return [
            actor
            for actor in ray_state.actors().values()
            if actor["ActorClassName"] == class_name
            and actor["State"] in ("ALIVE", "PENDING_CREATION")  # starting up or loading
            and actor["Pid"]
        ]

    def _live(self, states: tuple[str, ...]) -> list[tuple[str, str]]:
        """(id, user) of the evaluations in one of ``states`` now."""
        live = []
        for evaluation_id in self.load.unended():
            if self.load.status(self.service.url, evaluation_id) in states:
                live.append((evaluation_id, self.load.submitted[evaluation_id][0]))
        return live

    def _rank(self) -> bool:
        ranks = self._alive("ShardWorker")
        if not ranks:
            return False
        rank = self.rng.choice(ranks)
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank["Pid"], signal.SIGKILL)
        # A rank's name starts with the evaluation that started its group (kept warm, it may
        # be serving another by now).
        self._aim(str(rank["Name"]).removeprefix("rayeval-").split("-r")[0])
        return True

    def _aim(self, evaluation_id: str) -> None:
        """Note the recipe of the evaluation a fault is aimed at."""
        self._target = self.load.submitted.get(evaluation_id, ("", ""))[1]

    def _runner(self) -> bool:
        import ray

        running = self._live(("starting", "running"))  # a runner exists from "starting" on
        if not running:
            return False
        evaluation_id, _ = self.rng.choice(running)
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(f"rayeval-runner-{evaluation_id}", namespace="rayeval"))
            self._aim(evaluation_id)
            return True
        return False

    def _node(self) -> bool:
        cluster = self.service.cluster
        workers = [node for node in cluster.worker_nodes]
        victim = self.rng.choice(workers)
        cluster.remove_node(victim, allow_graceful=False)
        time.sleep(2.0)
        cluster.add_node(num_cpus=2)
        return True

    def _api(self) -> bool:
        self.service.stop()
        self.service.start()
        return True

    def _postgres(self) -> bool:
        if self.service.postgres is None:
            return False
        self.service.postgres.stop()
        time.sleep(OUTAGE_S["postgres"])
        self.service.postgres.start()
        return True

    def _stream(self) -> bool:
        live = self._live(("queued", "starting", "running"))
        if not live:
            return False
        evaluation_id, user = self.rng.choice(live)
        path = f"/evaluations/{evaluation_id}/events"
        first = read_sse(self.service.url, path, self.load.keys[user], stop_after=3)
        if not first:
            return False
        headers = {"Last-Event-ID": str(first[-1]["id"])}
        self._aim(evaluation_id)
        read: list[dict[str, Any]] = list(first)
        self.streams.append((evaluation_id, read))

        def follow() -> None:  # to the end of the evaluation, as a client that reconnected does
            read.extend(read_sse(self.service.url, path, self.load.keys[user], headers=headers))

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        self.followers.append(thread)
        return True

    def _disk(self) -> bool:
        if not self.service.cache_mounted:
            return False
        filler = self.service.data_dir / "response-cache" / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as out:
            block = b"\0" * (1 << 20)
            while True:
                out.write(block)
                out.flush()
        time.sleep(OUTAGE_S["disk"])
        filler.unlink()
        return True


def read_sse(
    url: str,
    path: str,
    key: str,
    headers: dict[str, str] | None = None,
    stop_after: int | None = None,
) -> list[dict[str, Any]]:
    """An SSE stream's events ({id, event, data}) to its end, or the first ``stop_after`` (the
    connection is then dropped); reconnects, with ``Last-Event-ID``, while the server is away."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        sent = dict(headers or {})
        if events:
            sent["Last-Event-ID"] = str(events[-1]["id"])
        try:
            if _read_stream(url, path, key, sent, events, stop_after):
                return events
        except httpx.HTTPError:
            pass  # the server restarted under the stream: follow it again from the last id
        time.sleep(1.0)
    return events


def _read_stream(
    url: str,
    path: str,
    key: str,
    headers: dict[str, str],
    events: list[dict[str, Any]],
    stop_after: int | None,
) -> bool:
    """Append the stream's events; True at its end (or after ``stop_after``)."""
    current: dict[str, Any] = {}
    headers = {**headers, "Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(30.0, read=60.0)
    with httpx.stream("GET", url + path, headers=headers, timeout=timeout) as response:
        if response.status_code != 200:
            return False
        for line in response.iter_lines():
            if line.startswith(":") or line.startswith("retry:"):
                continue
            if line:
                name, _, value = line.partition(": ")
                current[name] = int(value) if name == "id" else value
                continue
            if "event" in current:
                current["data"] = json.loads(current["data"])
                events.append(current)
                if stop_after is not None and len(events) >= stop_after:
                    return True
            current = {}
    return True


# ------------------------------------------------------------------------------ the checks
def quiet_pass(
    service: Service, bodies: dict[str, dict[str, Any]], latencies: list[float]
) -> dict[str, Any]:
    """Each recipe once without faults (no response cache): its samples, per task; the
    latencies of its status reads (the machine's own baseline for the soak's p99)."""
    service.response_cache = False
    service.start()
    keys = make_users(service.url, ADMIN, ["quiet"])
    ids = {name: _submit(service.url, keys["quiet"], body) for name, body in bodies.items()}
    reference = {}
    for name, evaluation_id in ids.items():
        assert evaluation_id is not None, f"the quiet pass could not submit {name}"
        final = wait_terminal(service.url, keys["quiet"], evaluation_id, 900, latencies)
        if final["status"] != "succeeded":
            raise SystemExit(f"the quiet pass's {name} {final['status']}: {final['error']}")
        reference[name] = samples(service.url, keys["quiet"], final)
    service.stop()
    service.response_cache = True
    return reference


def wait_terminal(
    url: str, key: str, evaluation_id: str, timeout_s: float, latencies: list[float] | None = None
) -> dict[str, Any]:
    """The evaluation once terminal, or as last seen after ``timeout_s`` (each read's latency
    added to ``latencies``)."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {"status": "unknown", "error": "never answered"}
    while time.monotonic() < deadline:
        sent = time.perf_counter()
        response = _get(url, f"/evaluations/{evaluation_id}", key)
        if latencies is not None and response is not None:
            latencies.append(time.perf_counter() - sent)
        if response is not None:
            state = response.json()
            if state["status"] in TERMINAL:
                break
        time.sleep(0.5)
    return state


def samples(url: str, key: str, evaluation: dict[str, Any]) -> dict[str, list[Any]]:
    """Per task, each document's (doc_id, filtered responses), in doc order; a sweep's per
    checkpoint and task (``label/task``; a checkpoint that did not succeed: ``label: status``,
    no documents)."""
    if not evaluation["request"].get("sweep"):
        links = evaluation["links"]["samples"]
        return {task: _sample_rows(url, key, link) for task, link in links.items()}
    response = _get(url, f"/evaluations/{evaluation['id']}/sweep", key)
    assert response is not None and response.status_code == 200, evaluation["id"]
    out: dict[str, list[Any]] = {}
    for record in response.json()["checkpoints"]:
        if record["status"] != "succeeded":
            out[f"{record['label']}: {record['status']}"] = []
        for task, link in (record.get("links") or {}).get("samples", {}).items():
            out[f"{record['label']}/{task}"] = _sample_rows(url, key, link)
    return out


def _sample_rows(url: str, key: str, link: str) -> list[Any]:
    response = _get(url, link, key)
    assert response is not None and response.status_code == 200, link
    return sorted((row["doc_id"], row["filtered_resps"]) for row in parse_samples(response.text))


def first_difference(ours: dict[str, list[Any]], reference: dict[str, list[Any]]) -> str:
    """Where the samples first differ from the reference's ('' where they are equal; a
    log-probability within 1e-4 is equal: batches differ)."""
    if ours.keys() != reference.keys():
        return f"tasks {sorted(ours)} instead of {sorted(reference)}"
    for task in ours:
        if len(ours[task]) != len(reference[task]):
            return f"{task}: {len(ours[task])} documents instead of {len(reference[task])}"
        for mine, theirs in zip(ours[task], reference[task], strict=True):
            if not _close(mine, theirs):
                return f"{task} document {mine[0]}: {mine[1]} instead of {theirs[1]}"[:300]
    return ""


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if a == b:
        return True
    try:  # lm-eval's samples file writes a log-probability as a string
        return abs(float(a) - float(b)) <= 1e-4
    except (TypeError, ValueError):
        return False


def check(
    service: Service,
    load: Load,
    injector: Injector,
    reference: dict[str, Any],
) -> dict[str, Any]:
    """Lost, wrong and left-behind, with what each one was; each evaluation a fault failed is
    retried once (a retry must succeed, equal the quiet pass, and take what was finished from
    the response cache)."""
    every = _everything(service.url)
    finals = _finals(service.url, every)
    failed = [f"{i}: {s['error']}"[:300] for i, s in finals.items() if s["status"] == "failed"]
    retries = _retry_failed(service.url, finals)
    finals.update(retries)
    lost = [f"{i}: {s['status']}" for i, s in finals.items() if s["status"] not in TERMINAL]
    lost += [f"retry {i}: {s['status']} ({s['error']})" for i, s in retries.items()
             if s["status"] != "succeeded"]  # fmt: skip
    wrong = []
    by_recipe: dict[str, Counter[str]] = {}
    for evaluation_id, state in finals.items():
        recipe = load.submitted.get(evaluation_id, (None, _recipe_of(state, load.bodies)))[1]
        by_recipe.setdefault(str(recipe), Counter())[state["status"]] += 1
        if state["status"] != "succeeded" or recipe is None:
            continue
        difference = first_difference(samples(service.url, ADMIN, state), reference[recipe])
        if difference:
            wrong.append(f"{evaluation_id} ({recipe}): {difference}")
    for evaluation_id, state in finals.items():
        events = read_sse(service.url, f"/evaluations/{evaluation_id}/events", ADMIN)
        lost += _event_losses(evaluation_id, events, state["status"])
    lost += _stream_losses(service.url, injector)
    twice = computed_twice(finals, [t for t, kind in injector.times if kind in KILLS])
    wrong += [f"computed twice: {what}" for what in twice["unexplained"]]
    statuses = Counter(s["status"] for i, s in finals.items() if i not in retries)
    service.stop()
    return {
        "computed_twice": twice,
        "evaluations": dict(statuses),
        "by_recipe": {recipe: dict(counts) for recipe, counts in sorted(by_recipe.items())},
        "failed": failed,
        "retried": len(retries),
        "retries_succeeded": sum(s["status"] == "succeeded" for s in retries.values()),
        "retries_cached_requests": sum(_cached(s) for s in retries.values()),
        "lost": lost,
        "wrong": wrong,
        "left_behind": left_behind([*every, *retries]),
    }


def computed_twice(finals: dict[str, dict[str, Any]], kills: list[float]) -> dict[str, Any]:
    """The answers the succeeded evaluations computed although the response cache held them
    already when they were stored (each one's figures' ``recomputed``), put down, per
    evaluation, to a kill while it ran that cost it a replica (its figures' ``requeued``: what
    that replica had in flight was computed again on another, and a streamed group's requests
    that had finished and been stored with it); else to another evaluation with a task in
    common running at the same time: each looked the answers up before the other stored them;
    else *unexplained*: a finished micro-batch computed twice (the soak counts each one as
    wrong)."""
    spans = {i: _span(state) for i, state in finals.items()}
    tasks = {i: set(state["request"]["tasks"]) for i, state in finals.items()}
    counts: Counter[str] = Counter()
    unexplained = []
    for evaluation_id, state in finals.items():
        figures = (state.get("stats") or {}).values()
        answers = sum(int(p.get("recomputed", 0)) for p in figures)
        if not answers:
            continue
        begin, end = spans[evaluation_id]
        at_once = any(
            other != evaluation_id and tasks[other] & tasks[evaluation_id] and b < end and begin < e
            for other, (b, e) in spans.items()
        )
        lost_a_replica = any(int(p.get("requeued", 0)) for p in figures)
        if lost_a_replica and any(begin <= at <= end for at in kills):
            counts["at_a_kill"] += answers
        elif at_once:
            counts["at_once"] += answers
        else:
            counts["unexplained"] += answers
            unexplained.append(f"{evaluation_id}: {answers} answers")
    return {
        "answers": sum(counts.values()),
        "at_a_kill": counts["at_a_kill"],
        "at_once": counts["at_once"],
        "unexplained": unexplained,
    }


def _span(state: dict[str, Any]) -> tuple[float, float]:
    """When an evaluation started (else was created) and ended (else now), as time.time()."""
    begin = state.get("started_at") or state["created_at"]
    end = state.get("finished_at")
    return (
        datetime.fromisoformat(begin).timestamp(),
        datetime.fromisoformat(end).timestamp() if end else time.time(),
    )


def _finals(url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    return {evaluation_id: wait_terminal(url, ADMIN, evaluation_id, 600) for evaluation_id in ids}


def _retry_failed(url: str, finals: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Retry each failed evaluation once, as its owner would; the retries once terminal."""
    retried = []
    for evaluation_id, state in finals.items():
        if state["status"] == "failed":
            response = httpx.post(
                f"{url}/evaluations/{evaluation_id}/retry",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=60,
            )
            response.raise_for_status()
            retried.append(str(response.json()["id"]))
    return _finals(url, retried)


def _cached(state: dict[str, Any]) -> int:
    """Requests the evaluation took from the response cache."""
    return sum(int(phase.get("cached", 0)) for phase in (state.get("stats") or {}).values())


def _stream_losses(url: str, injector: Injector) -> list[str]:
    """Each dropped stream, followed again, must have read exactly the stored events."""
    lost = []
    for thread in injector.followers:
        thread.join(timeout=60)
    for evaluation_id, read in injector.streams:
        stored = read_sse(url, f"/evaluations/{evaluation_id}/events", ADMIN)
        if [e["id"] for e in read] != [e["id"] for e in stored]:
            lost.append(f"{evaluation_id}: the resumed stream read {len(read)} of {len(stored)}")
    return lost


def _everything(url: str) -> list[str]:
    ids: list[str] = []
    while True:
        response = _get(url, "/evaluations", ADMIN, limit=100, offset=len(ids))
        if response is None:
            time.sleep(1.0)
            continue
        page = response.json()
        ids += [item["id"] for item in page["items"]]
        if len(ids) >= page["total"] or not page["items"]:
            return ids


def _recipe_of(state: dict[str, Any], bodies: dict[str, dict[str, Any]]) -> str | None:
    """The recipe of an evaluation stored by a POST that went unanswered (a restart)."""
    for name, body in bodies.items():
        if (
            list(state["request"]["tasks"]) == body["tasks"]
            and state["request"]["limit"] == body["limit"]
            and (state["request"].get("gen_kwargs") or {}) == body.get("gen_kwargs", {})
            and bool(state["request"].get("sweep")) == ("sweep" in body)
        ):
            return name
    return None


def _event_losses(evaluation_id: str, events: list[dict[str, Any]], status: str) -> list[str]:
    ids = [e["id"] for e in events]
    if ids != list(range(1, len(ids) + 1)):
        return [f"{evaluation_id}: event ids {ids} have a gap or are out of order"]
    states = [e["data"]["status"] for e in events if e["event"] == "state"]
    if not states or states[-1] != status:
        return [f"{evaluation_id}: its events end in {states[-1:]} but it is {status}"]
    return []


def left_behind(evaluation_ids: list[str], timeout_s: float = 60.0) -> list[str]:
    """Actors, rank and runner processes, placement groups of this cluster and the evaluations'
    temporary folders still there (after the server stopped; Ray gets the time it takes to reap
    what was released). The machine is shared: other people's folders and processes are not
    looked at."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = _leftovers() + _scratch_folders(evaluation_ids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(2.0)


def _scratch_folders(evaluation_ids: list[str]) -> list[str]:
    """The runners' temporary folders (``rayeval-<evaluation>-...``) of these evaluations."""
    scratch = Path(tempfile.gettempdir())
    return [
        f"temporary {path}"
        for evaluation_id in evaluation_ids
        for path in sorted(scratch.glob(f"rayeval-{evaluation_id}-*"))
    ]


def _leftovers() -> list[str]:
    import psutil
    import ray
    from ray._private import state as ray_state  # the GCS's table: no dashboard here

    actors = list(ray_state.actors().values())
    left = [f"actor {a['ActorClassName']} {a['Name']}" for a in actors if a["State"] != "DEAD"]
    left += [
        f"placement group {pg_id}"
        for pg_id, pg in ray.util.placement_group_table().items()
        if pg["state"] != "REMOVED"
    ]
    for actor in actors:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(actor["Pid"])
            if process.cmdline()[:1] == [f"ray::{actor['ActorClassName']}"]:
                left.append(f"process {actor['Pid']} of {actor['ActorClassName']} {actor['Name']}")
    return left


# ------------------------------------------------------------------------------------ main
def soak(service: Service, load: Load, injector: Injector, seconds: float, short: bool) -> None:
    """The users, the poller and the injector for ``seconds``."""
    threads = [threading.Thread(target=user_loop, args=(service, load, u)) for u in load.keys]
    threads.append(threading.Thread(target=poller, args=(service, load)))
    for thread in threads:
        thread.start()
    started = time.monotonic()
    plan = list(KINDS)
    injector.rng.shuffle(plan)
    # --short: one of each kind, evenly spread, a pause after each. Else faults start at seeded
    # times GAP_S apart on average (half to one and a half of it), counted from one start to
    # the next, so that the faults' own length (an API restart, a full disk) and the waits for
    # a target do not thin them out: about 44 in ten minutes, at least 30 unless faults and
    # their waits outlast the whole soak.
    gap = (seconds - 15.0) / len(plan) if short else GAP_S
    warm_up = 15.0 if short else 30.0
    time.sleep(warm_up)  # the first evaluations running
    due = started + warm_up
    while plan if short else time.monotonic() - started < seconds:
        kind = plan.pop(0) if short else injector.rng.choice(KINDS)
        tried = 0  # --short must inject every kind: it waits longer for a target
        while not injector.inject(kind) and tried < (30 if short else 10):
            tried += 1
            time.sleep(2.0)
        if short:
            time.sleep(gap)
            continue
        due += gap * injector.rng.uniform(0.5, 1.5)
        load.stop.wait(max(0.0, due - time.monotonic()))
    load.stop.set()
    for thread in threads:
        thread.join(timeout=120)


def away_from_restarts(load: Load, injector: Injector, after_s: float = AFTER_RESTART_S) -> Any:
    """The status reads' percentiles without those within ``after_s`` after an API server
    restart began (the new server starts its runners' re-attachment and lm-eval's task index
    scan then), and how many reads that leaves out."""
    restarts = [at for at, kind in injector.times if kind == "api"]
    kept = [
        latency
        for latency, at in zip(load.latencies, load.read_at, strict=True)
        if not any(0 <= at - restart <= after_s for restart in restarts)
    ]
    return {**(percentiles(kept) if kept else {}), "left_out": len(load.latencies) - len(kept)}


def table(report: dict[str, Any]) -> str:
    """The faults by kind, then the checks, as Markdown tables."""
    rows = ["| fault | injected | no target then |", "|---|---:|---:|"]
    for kind in KINDS:
        injected, skipped = report["faults"].get(kind, 0), report["skipped"].get(kind, 0)
        rows.append(f"| {kind} | {injected} | {skipped} |")
    soak, quiet = report["status_reads"], report["status_reads_quiet_pass"]
    fresh, twice = report["status_reads_new_client"], report["computed_twice"]
    away = report["status_reads_away_from_restarts"]
    checks = {
        "evaluations (by end state)": report["evaluations"],
        "rank, runner and stream faults, by the recipe they hit": ", ".join(
            f"{recipe} {n}" for recipe, n in sorted(report["aimed_by_recipe"].items())
        ),
        "by recipe (retries included)": ", ".join(
            f"{recipe} {'/'.join(f'{n} {status}' for status, n in counts.items())}"
            for recipe, counts in report["by_recipe"].items()
        ),
        "failed by a fault, retried / retry succeeded": (
            f"{report['retried']} / {report['retries_succeeded']} "
            f"({report['retries_cached_requests']} requests from the cache)"
        ),
        "answers computed twice: in flight at a kill / by two evaluations at once / else": (
            f"{twice['at_a_kill']} / {twice['at_once']} / {len(twice['unexplained'])}"
        ),
        "lost": len(report["lost"]),
        "wrong": len(report["wrong"]),
        "left behind": len(report["left_behind"]),
        "status p50 / p99 / max, soak": (
            f"{soak.get('p50_ms')} / {soak.get('p99_ms')} / {soak.get('max_ms')} ms "
            f"({soak.get('reads')} reads, {report['status_unavailable']} unanswered)"
        ),
        f"status p50 / p99 / max, soak, not within {AFTER_RESTART_S:g} s of an API restart": (
            f"{away.get('p50_ms')} / {away.get('p99_ms')} / {away.get('max_ms')} ms "
            f"({away.get('reads')} reads; {away['left_out']} left out)"
        ),
        "status p50 / p99 / max, soak, a new client per read": (
            f"{fresh.get('p50_ms')} / {fresh.get('p99_ms')} / {fresh.get('max_ms')} ms "
            f"({fresh.get('reads')} reads)"
        ),
        "status p50 / p99, quiet pass": f"{quiet['p50_ms']} / {quiet['p99_ms']} ms",
        "rank niceness": report["rank_niceness"],
    }
    rows += ["", "| check | result |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in checks.items()]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--short", action="store_true", help="about 2 minutes, one of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--rank-niceness", type=int, default=None, help="the server's (default: its default)"
    )
    args = parser.parse_args()
    seconds = 75.0 if args.short else 60.0 * args.minutes

    from rayeval.service.demo import ensure_demo_assets

    assets = ensure_demo_assets()
    with tempfile.TemporaryDirectory(prefix="chaos-") as root:
        run_dir = Path(root) / "run"
        make_checkpoints(assets.model_dir, run_dir)
        bodies = recipes(str(assets.model_dir), run_dir)
        service = start_service(assets, Path(root))
        service.rank_niceness, service.run_dir = args.rank_niceness, run_dir
        try:
            started = time.monotonic()
            quiet_reads: list[float] = []
            reference = quiet_pass(service, bodies, quiet_reads)
            quiet_s = time.monotonic() - started
            service.start()
            keys = make_users(service.url, ADMIN, [f"user{i}" for i in range(USERS)])
            load = Load(keys, bodies, random.Random(args.seed))
            injector = Injector(service, load, random.Random(args.seed + 1))
            soak(service, load, injector, seconds, args.short)
            outcome = check(service, load, injector, reference)
        finally:
            stop_service(service)
    report = {
        "seed": args.seed,
        "soak_s": round(seconds),
        "quiet_pass_s": round(quiet_s),
        "store": "postgresql" if service.postgres is not None else "sqlite",
        "notes": service.notes,
        "unavailable": [
            kind
            for kind, there in (("postgres", service.postgres), ("disk", service.cache_mounted))
            if not there
        ],
        "faults": dict(injector.faults),
        "aimed_by_recipe": dict(injector.aimed),
        "skipped": dict(injector.skipped),
        "rank_niceness": "server default" if args.rank_niceness is None else args.rank_niceness,
        "status_reads": percentiles(load.latencies) if load.latencies else {},
        "status_reads_away_from_restarts": away_from_restarts(load, injector),
        "status_reads_new_client": (
            percentiles(load.fresh_latencies) if load.fresh_latencies else {}
        ),
        "status_unavailable": load.unavailable,
        "status_reads_quiet_pass": percentiles(quiet_reads),
        **outcome,
        "fault_log": injector.log,
    }
    print(table(report))
    print(json.dumps({k: v for k, v in report.items() if k != "fault_log"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    faults = sum(injector.faults.values())
    lost, wrong, left = len(outcome["lost"]), len(outcome["wrong"]), len(outcome["left_behind"])
    print(
        f"chaos: {faults} faults of {len(injector.faults)} kinds, lost {lost}, wrong {wrong}, "
        f"left behind {left}"
    )
    return 1 if lost or wrong or left else 0


if __name__ == "__main__":
    sys.exit(main())
