"""The worker group of one evaluation: a placement group, R x G rank actors, R process groups.

``WorkerGroup.create`` refuses a layout the cluster can never hold, reserves the placement group
(``rayeval.actors.placement``: waits with a timeout that reports requested vs available resources,
then maps bundles to ranks so that a replica sits on one node when it fits there), settles how
replicas shard the model (``rayeval.actors.parallel.sharding``: tensor parallelism needs a replica's
ranks on one node), starts one actor per bundle and has every replica form its process group and
load the model. A partial start is cleaned up: no actor or placement group outlives a failed
``create``. A rank process that dies while loading (killed, or its node lost) has every rank
started again once, in the same placement group: loading changes nothing outside the ranks, so
it is safe to repeat. ``shutdown`` releases everything.
"""

from __future__ import annotations

import logging
import pickle
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from rayeval.actors.batches import (
    DEFAULT_GENERATE_ROWS,
    DEFAULT_LOGITS_BUDGET_MIB,
    PIECES_PER_S,
    GenerateGroup,
    MicroBatch,
    ModelSpec,
    Pickled,
    RankOptions,
)
from rayeval.actors.errors import (
    LOG_FILE_ONLY,
    EvaluationTimeoutError,
    ModelLoadError,
    RayEvalError,
)
from rayeval.actors.layout import DeviceKind, ParallelLayout, ShardStrategy, Timeouts
from rayeval.actors.parallel.strategies import settle, strategy
from rayeval.actors.placement import Placement, reserve
from rayeval.actors.process import rank_environment
from rayeval.actors.protocol import InputTokens, LoadReport, NodeInfo, RankSite, SwapReport
from rayeval.actors.rank_death import death_report

logger = logging.getLogger(__name__)

#: Times a worker group starts its ranks again when one dies while loading the model.
RESTARTS_WHILE_LOADING = 1


class Replica:
    """The G rank actors of one replica, in shard-rank order.

    Args:
        index: The replica's number.
        workers: Its rank actors.
        same_batch: Whether its ranks compute one micro-batch together (tensor parallelism)
            rather than one each (FSDP).
    """

    def __init__(self, index: int, workers: list[Any], same_batch: bool = False) -> None:
        self.index = index
        self.workers = workers
        self.same_batch = same_batch

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches one step computes: one per rank, or one for all ranks together."""
        return 1 if self.same_batch else len(self.workers)

    def submit(self, micro_batches: list[MicroBatch]) -> list[Any]:
        """Send one step to every rank: micro-batch ``i`` to shard rank ``i``, or the one
        micro-batch to all ranks when they compute it together. Returns one ref per rank, or
        for continuous-batching groups one Ray streaming generator per rank."""
        if len(micro_batches) != self.micro_batches_per_step:
            raise ValueError(
                f"a step needs {self.micro_batches_per_step} micro-batches, got "
                f"{len(micro_batches)}"
            )
        # Pickled by the C pickler (Ray's cloudpickle visits each request in Python), once per
        # micro-batch; each rank receives the micro-batch itself.
        payloads = [Pickled.of(mb) for mb in micro_batches]
        per_rank = payloads * len(self.workers) if self.same_batch else payloads
        pairs = zip(self.workers, per_rank, strict=True)
        if isinstance(micro_batches[0], GenerateGroup):
            return [w.generate_stream.options(num_returns="streaming").remote(p) for w, p in pairs]
        return [w.compute.remote(payload) for w, payload in pairs]

    def submit_many(self, steps: list[list[MicroBatch]]) -> list[Any]:
        """Send several steps in one call per rank (``compute_many``): each rank computes its
        micro-batch of every step, in order, as :meth:`submit` would send them one by one.
        Returns one ref per rank (:meth:`answers_many` reads their values).

        Micro-batches and outputs travel pickled: Ray pickles with cloudpickle, which visits
        every row in Python; the C pickler does the same in a fraction of the time.
        """
        for step in steps:
            if len(step) != self.micro_batches_per_step:
                raise ValueError(
                    f"a step needs {self.micro_batches_per_step} micro-batches, got {len(step)}"
                )
        return [
            worker.compute_many.remote(
                pickle.dumps([step[0 if self.same_batch else rank] for step in steps], protocol=5),
            )
            for rank, worker in enumerate(self.workers)
        ]

    def answers_many(self, values: list[bytes]) -> list[list[Any]]:
        """Per step of a :meth:`submit_many` call, its (result, stats) per micro-batch, from
        what the ranks returned (each its pickled outputs, one per step)."""
        per_rank = [pickle.loads(value) for value in values]
        return [
            self.answers([outputs[step] for outputs in per_rank])
            for step in range(len(per_rank[0]))
        ]

    def answers(self, outputs: list[Any]) -> list[Any]:
        """The answers of one step from what its ranks returned (one per rank): one per
        micro-batch (ranks that computed a micro-batch together all return its answer)."""
        return outputs[:1] if self.same_batch else outputs

    def kill(self) -> None:
        """Kill every rank actor of this replica (pending calls fail at once)."""
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


class WorkerGroup:
    """All replicas of one evaluation and the placement group that holds them."""

    def __init__(
        self,
        name: str,
        layout: ParallelLayout,
        pg: PlacementGroup,
        replicas: list[Replica],
        placement: Placement | None = None,
    ) -> None:
        self.name = name
        self.layout = layout
        self.replicas = replicas
        #: Where each global rank runs (node, device) and which bundle holds it.
        self.placement = placement
        #: How the replicas shard the model (FSDP for G = 1, where nothing is sharded).
        self.strategy = ShardStrategy.FSDP
        self._pg: PlacementGroup | None = pg
        self._setup_refs: list[ray.ObjectRef] = []
        self._load_timeout_s = 0.0
        self._deadline = 0.0
        #: How the ranks were started, to start them again once if one dies while loading.
        self._start_args: tuple[Placement, ModelSpec, RankOptions, type | None, int | None]
        self._restarts_left = RESTARTS_WHILE_LOADING
        self.load_reports: list[LoadReport] = []

    @classmethod
    def create(
        cls,
        name: str,
        layout: ParallelLayout,
        spec: ModelSpec,
        timeouts: Timeouts,
        seed: int = 1234,
        strategy: ShardStrategy | str = ShardStrategy.FSDP,
        obstacles: Mapping[ShardStrategy, Sequence[str]] | None = None,
        shm_collectives: bool = True,
        logits_budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB,
        generate_rows: int = DEFAULT_GENERATE_ROWS,
        rank_class: type | None = None,
        niceness: int | None = None,
    ) -> WorkerGroup:
        """Reserve resources and start the rank actors; model loading starts in the background
        (call :meth:`wait_ready` before sending work).

        Args:
            name: The evaluation's name (placement group, actor-name prefix).
            layout: R x G ranks.
            spec: The model.
            timeouts: Every wait.
            seed: The ranks' torch seed.
            strategy: How replicas shard the model (``auto``: the first registered strategy
                that can run it).
            obstacles: Per strategy, why it cannot shard this model at this G
                (:func:`rayeval.actors.parallel.strategies.model_obstacles`; None: nothing
                in the way).
            shm_collectives: Whether ranks of a replica on one node may exchange activations
                through shared memory.
            logits_budget_mib: MiB of logits a rank's scoring micro-batch holds at once.
            generate_rows: Most rows a generation group computes at once.
            rank_class: The rank actors' class (None: ``ShardWorker``); tests' and benchmarks'
                simulated rank, which loads no model.
            niceness: The OS niceness of the rank processes (None: Ray's default for its
                workers; :func:`rayeval.actors.process.rank_environment`).

        Raises:
            LayoutError: if the layout is larger than the whole cluster, or ``tp`` was asked
                and a replica was placed across nodes.
            ConfigError: a strategy was asked for a model it cannot shard.
            ResourcesUnavailableError: if the placement group is not ready within the timeout.
        """
        layout.check_fits(ray.cluster_resources())
        placement = reserve(name, layout, timeouts.placement_s)
        group = cls(name, layout, placement.pg, replicas=[], placement=placement)
        group._load_timeout_s = timeouts.load_s
        group._deadline = time.monotonic() + timeouts.load_s
        try:
            split = placement.split_replicas(layout)
            group.strategy = settle(strategy, layout.shard_size, obstacles or {}, split)
            if layout.sharded:
                logger.info("%s: replicas shard the model with %s", name, group.strategy.value)
            options = replace(
                group._rank_options(timeouts, seed, shm_collectives, split),
                logits_budget_mib=logits_budget_mib,
                generate_rows=generate_rows,
            )
            group._start_actors(placement, spec, options, rank_class, niceness)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _rank_options(
        self,
        timeouts: Timeouts,
        seed: int,
        shm_collectives: bool,
        split: Sequence[int],
    ) -> RankOptions:
        """What every rank of the group is told (the strategy is settled)."""
        return RankOptions(
            shard_size=self.layout.shard_size,
            device=self.layout.device,
            collective_timeout_s=timeouts.collective_s,
            seed=seed,
            strategy=self.strategy,
            shm_collectives=shm_collectives,
            piece_interval_s=self.layout.world / PIECES_PER_S,
            split_replicas=tuple(split),
        )

    def _start_actors(
        self,
        placement: Placement,
        spec: ModelSpec,
        options: RankOptions,
        rank_class: type | None = None,
        niceness: int | None = None,
    ) -> None:
        self._start_args = (placement, spec, options, rank_class, niceness)
        if rank_class is None:
            from rayeval.actors.worker import ShardWorker

            rank_class = ShardWorker
        remote_cls: Any = ray.remote(rank_class)
        workers = []
        for coord in self.layout.coords():
            workers.append(
                remote_cls.options(
                    name=f"{self.name}-r{coord.replica}-s{coord.shard_rank}",
                    num_cpus=self.layout.cpus_per_rank,
                    num_gpus=1 if self.layout.device is DeviceKind.CUDA else 0,
                    max_restarts=0,
                    runtime_env={"env_vars": rank_environment(self.layout.device, niceness)},
                    # The bundle chosen for this rank, not bundle == rank: see actors.placement.
                    scheduling_strategy=placement.scheduling(coord.global_rank),
                ).remote(spec, coord, options)
            )
        G = self.layout.shard_size
        same_batch = self.layout.sharded and strategy(self.strategy).same_batch
        self.replicas = [
            Replica(r, workers[r * G : (r + 1) * G], same_batch)
            for r in range(self.layout.num_replicas)
        ]
        # Shard rank 0 of each replica picks the rendezvous address; all ranks then join and load.
        # Nothing here blocks: Ray hands the address to `setup` once rank 0 has it, so actor
        # start-up and model loading overlap with lm-eval building its requests on the driver.
        for replica in self.replicas:
            rendezvous = replica.workers[0].reserve_port.remote()
            self._setup_refs += [worker.setup.remote(rendezvous) for worker in replica.workers]

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches one step of one replica computes (G under FSDP, 1 under TP)."""
        if self.layout.sharded and strategy(self.strategy).same_batch:
            return 1
        return self.layout.shard_size

    def wait_ready(self) -> list[LoadReport]:
        """Wait (bounded) until every rank has loaded the model; return their load reports.

        Raises:
            EvaluationTimeoutError: if loading outlasts the load timeout.
            ModelLoadError: if a rank failed to load (the first failure's message).
        """
        if self.load_reports or not self._setup_refs:
            return self.load_reports
        while True:
            try:
                return self._wait_loaded()
            except ray.exceptions.RayActorError as died:
                report = death_report(died)
                if not self._restarts_left:
                    raise ModelLoadError(
                        f"a rank died while loading the model, after its ranks were started "
                        f"again: {report}"
                    ) from None
                self._restarts_left -= 1
                logger.warning(
                    "%s: a rank died while loading the model (%s); starting its ranks again",
                    self.name,
                    report,
                )
                self._start_again()

    def _start_again(self) -> None:
        """Kill every rank (those still loading too: their process groups lost a member) and
        start them again in the same bundles, with the whole load timeout before them."""
        for replica in self.replicas:
            replica.kill()
        names = [f"{self.name}-r{c.replica}-s{c.shard_rank}" for c in self.layout.coords()]
        if not _names_freed(names, timeout_s=60.0):
            raise ModelLoadError(
                f"a rank of {self.name} died while loading the model, and its killed ranks "
                "still held their names after 60s: check `ray list actors`, then retry"
            )
        self.replicas, self._setup_refs = [], []
        self._deadline = time.monotonic() + self._load_timeout_s
        self._start_actors(*self._start_args)

    def _wait_loaded(self) -> list[LoadReport]:
        """Wait for the ranks' loading (:meth:`wait_ready`).

        Raises:
            ray.exceptions.RayActorError: a rank process died (the caller may start it again).
        """
        # One rank at a time, so that a rank that fails (say, it cannot reach its replica's
        # other nodes) is reported at once, not after the others time out waiting for it.
        pending = list(self._setup_refs)
        while pending:
            remaining = max(0.0, self._deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                break
            _get_or_raise(ready[0], ModelLoadError, "loading the model", died=True)
        if pending:
            raise EvaluationTimeoutError(
                f"{len(pending)} of {len(self._setup_refs)} ranks did not finish loading the model "
                f"within {self._load_timeout_s:g}s: raise the load timeout for very large models, "
                "or check the Ray dashboard / worker logs for a stuck rank."
            )
        self.load_reports = [
            _get_or_raise(ref, ModelLoadError, "loading the model", died=True)
            for ref in self._setup_refs
        ]
        return self.load_reports

    def ranks_loaded(self) -> int:
        """How many ranks have finished loading (or failed to), without waiting: the
        start-up's progress (kept ranks: all of them)."""
        if self.load_reports or not self._setup_refs:
            return self.layout.world
        ready, _ = ray.wait(
            self._setup_refs, num_returns=len(self._setup_refs), timeout=0, fetch_local=False
        )
        return len(ready)

    def begin_evaluation(self, seed: int, timeout_s: float) -> None:
        """Seed every loaded rank for a new evaluation (a group kept between evaluations).

        Raises:
            RayEvalError: a rank is gone or did not answer within ``timeout_s`` (the group
                cannot be reused).
        """
        refs = [w.begin_evaluation.remote(seed) for r in self.replicas for w in r.workers]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise RayEvalError(f"{len(pending)} kept ranks did not answer within {timeout_s:g}s")
        for ref in ready:
            _get_or_raise(ref, RayEvalError, "starting an evaluation")

    def load_checkpoint(self, checkpoint: str, timeout_s: float) -> list[SwapReport]:
        """Have every rank swap in the weights of ``checkpoint``, in place
        (:meth:`rayeval.actors.worker.ShardWorker.load_checkpoint`); returns their reports.

        Raises:
            EvaluationTimeoutError: a rank did not finish within ``timeout_s``.
            ModelLoadError: a rank could not read the checkpoint (the first failure's message).
        """
        self.wait_ready()
        refs = [w.load_checkpoint.remote(checkpoint) for r in self.replicas for w in r.workers]
        return self._swapped(refs, checkpoint, timeout_s)

    def load_adapter(self, peft: str, timeout_s: float) -> list[SwapReport]:
        """Have every rank swap in another checkpoint of its LoRA adapter, in place
        (:meth:`rayeval.actors.worker.ShardWorker.load_adapter`); returns their reports.

        Raises:
            EvaluationTimeoutError: a rank did not finish within ``timeout_s``.
            ModelLoadError: a rank could not read the adapter (the first failure's message).
        """
        self.wait_ready()
        refs = [w.load_adapter.remote(peft) for r in self.replicas for w in r.workers]
        return self._swapped(refs, peft, timeout_s)

    def _swapped(self, refs: list[Any], path: str, timeout_s: float) -> list[SwapReport]:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise EvaluationTimeoutError(
                f"{len(pending)} of {len(refs)} ranks did not finish reading {path} within "
                f"{timeout_s:g}s: raise the load timeout, or check the ranks' logs"
            )
        return [_get_or_raise(ref, ModelLoadError, f"reading {path}") for ref in refs]

    def input_token_counts(self, timeout_s: float) -> InputTokens:
        """Tokens the ranks' models were fed so far, summed over ranks
        (:meth:`rayeval.actors.worker.ShardWorker.input_token_counts`).

        Raises:
            GetTimeoutError: the ranks did not answer within ``timeout_s``.
        """
        self.wait_ready()
        refs = [w.input_token_counts.remote() for r in self.replicas for w in r.workers]
        return sum(ray.get(refs, timeout=timeout_s), InputTokens())

    def kv_capacity_tokens(self, timeout_s: float) -> list[int | None]:
        """The KV-cache positions each rank's free memory holds now
        (:meth:`rayeval.actors.worker.ShardWorker.kv_capacity_tokens`), in global rank order;
        None for a rank that died (its replica is dropped when it is next given work).

        Raises:
            EvaluationTimeoutError: a live rank did not answer within ``timeout_s``.
        """
        self.wait_ready()
        refs = [w.kv_capacity_tokens.remote() for r in self.replicas for w in r.workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for ref in pending:
                ray.cancel(ref)
            raise EvaluationTimeoutError(
                f"{len(pending)} of {len(refs)} ranks did not say how much memory they hold "
                f"within {timeout_s:g}s: check the Ray dashboard / worker logs for a stuck rank."
            )
        held: list[int | None] = []
        for ref in refs:
            try:
                held.append(ray.get(ref))
            except ray.exceptions.RayActorError:  # a lost rank: it holds nothing for the plan
                held.append(None)
        return held

    def rank_sites(self, timeout_s: float = 60.0) -> list[RankSite]:
        """Where every rank runs, in global rank order, as each rank actor reports it (not as
        it was planned).

        Raises:
            EvaluationTimeoutError: if the ranks do not answer within ``timeout_s``.
        """
        workers = [
            (replica.index, shard_rank, worker)
            for replica in self.replicas
            for shard_rank, worker in enumerate(replica.workers)
        ]
        refs = [worker.node_info.remote() for _, _, worker in workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for ref in refs:
                ray.cancel(ref)
            raise EvaluationTimeoutError(
                f"{len(pending)} of {len(refs)} ranks did not say where they run within "
                f"{timeout_s:g}s: check the Ray dashboard / worker logs for a stuck rank."
            )
        sites = []
        for (replica, shard_rank, _), ref in zip(workers, refs, strict=True):
            info: NodeInfo = _get_or_raise(ref, RayEvalError, "reporting where it runs")
            sites.append(RankSite(replica, shard_rank, info.node_id, info.ip, info.pid))
        return sites

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group. Safe to call more than once."""
        for replica in self.replicas:
            for worker in replica.workers:
                try:
                    ray.kill(worker, no_restart=True)
                except Exception:  # already dead
                    logger.debug("worker of %s already gone", self.name)
        self.replicas = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _get_or_raise(
    ref: ray.ObjectRef, error: type[RayEvalError], doing: str, died: bool = False
) -> Any:
    """``ray.get`` one finished ref, turning a worker-side exception into a clean rayeval error
    (``died``: a dead rank's ``RayActorError`` is raised as it is, for the caller to handle)."""
    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as exc:
        raise rank_failure(exc, error, doing) from None
    except ray.exceptions.RayActorError as exc:
        if died:
            raise
        raise error(f"a rank died while {doing}: {death_report(exc)}") from None


def _names_freed(names: Sequence[str], timeout_s: float) -> bool:
    """Whether no live actor holds one of ``names`` within ``timeout_s`` (killed ranks give
    their names back once Ray has marked them dead)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def rank_failure(
    exc: ray.exceptions.RayTaskError, error: type[RayEvalError], doing: str, oom_hint: str = ""
) -> RayEvalError:
    """The driver-side error for an exception raised inside a rank actor.

    A rayeval error keeps its own class and message (it already names the fix); anything else
    becomes ``error`` naming what the rank was doing, the cause and the file and line of the
    rank's code that raised it, with ``oom_hint`` (what to lower) appended only when the cause
    was running out of memory (:func:`out_of_memory`): a hint about memory under any other error
    would point the user away from the real cause. The rank's whole traceback goes to the log
    file (and the console with ``--verbose``), since the raised error carries none of it.
    """
    cause = exc.cause
    # Ray's text of it: the rank's task, pid, node and actor, then its traceback (the exception
    # Ray raises on the driver may be a copy of the cause's class that holds nothing else).
    text = str(exc)
    logger.error("a rank failed while %s:\n%s", doing, text.rstrip(), extra=LOG_FILE_ONLY)
    if isinstance(cause, RayEvalError):
        failure = type(cause)(cause.marked_message)
    else:
        hint = oom_hint if out_of_memory(cause) else ""
        where = raised_at(text)
        at = f" (at {where})" if where else ""
        failure = error(f"a rank failed while {doing}: {type(cause).__name__}: {cause}{at}{hint}")
    failure.traceback = text
    return failure


def raised_at(traceback_str: str) -> str | None:
    """Where a traceback's text says it raised: ``file:line in function`` of its innermost
    frame, and of rayeval's own innermost frame where that is another one (``... from ...``);
    files inside the project or ``site-packages`` are named from there. None when the text
    names no frame."""
    frames = _FRAME.findall(traceback_str)
    if not frames:
        return None
    ours = [frame for frame in frames if _ours(frame[0])]
    where = _frame_text(frames[-1])
    if ours and ours[-1] != frames[-1]:
        where += f", from {_frame_text(ours[-1])}"
    return where


def _ours(path: str) -> bool:
    """A file of rayeval's own (not one of a virtual environment inside the checkout)."""
    return path.startswith(_PROJECT) and "site-packages/" not in path[len(_PROJECT) :]


def _frame_text(frame: tuple[str, str, str]) -> str:
    path, line, function = frame
    if _ours(path):
        path = path[len(_PROJECT) :]
    return f"{path.rsplit('site-packages/', 1)[-1]}:{line} in {function}"


#: The folder holding rayeval's packages (the checkout, or site-packages/rayeval/).
_PROJECT = str(Path(__file__).resolve().parents[1]) + "/"
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def out_of_memory(cause: BaseException | None) -> bool:
    """Whether a rank's exception is running out of memory: a ``MemoryError`` (host), a
    ``torch.OutOfMemoryError`` (device), or a ``RuntimeError`` whose message says so ("out of
    memory" from CUDA and other device allocators; torch's CPU allocator's "can't allocate
    memory"). Reads the class by name, so the driver needs no torch."""
    if cause is None:
        return False
    if isinstance(cause, MemoryError):
        return True
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(cause).__mro__):
        return True
    message = str(cause).lower()
    return isinstance(cause, RuntimeError) and any(words in message for words in _OOM_WORDS)


#: What an allocator's RuntimeError says when it ran out of memory.
_OOM_WORDS = ("out of memory", "can't allocate memory")
