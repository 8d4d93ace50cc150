"""What one request type (a *phase*: loglikelihood, generate_until, ...) did, step by step.

:class:`PhaseStats` accumulates a request type's figures over an evaluation (requests, tokens,
seconds, per-replica work) for the results and the benchmarks. :class:`PhaseTracker` follows one
run of micro-batches: after every finished step it adds the step's figures, moves the progress
bar and reports a :class:`rayeval.service.vocabulary.events.Progress` when one is due (the first and
last moves, and in between every 1/200 of the requests or every second).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from rayeval.service.console import progress_stream, redraw_every_s
from rayeval.service.engine.dispatch.dispatcher import PieceDone, StepDone
from rayeval.service.vocabulary.events import Progress, RankMemory, ReplicaWork

#: Progress is reported once at least this share of a run's requests moved since the last report
#: (every move of a run of fewer than 1/REPORT_SHARE requests), or after REPORT_EVERY_S.
REPORT_SHARE = 1 / 200
REPORT_EVERY_S = 1.0


@dataclass
class PhaseStats:
    """Throughput figures of one request type (for reports and benchmarks)."""

    requests: int = 0
    cached: int = 0
    #: Computed answers the response cache held already when they were stored: computed twice
    #: (in flight at a kill, or by another evaluation at the same time).
    recomputed: int = 0
    #: Micro-batches computed again on another replica because theirs was lost mid-run.
    requeued: int = 0
    micro_batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    replica_busy_s: dict[int, float] = field(default_factory=dict)
    replica_requests: dict[int, int] = field(default_factory=dict)
    replica_tokens: dict[int, int] = field(default_factory=dict)
    #: How generate_until requests were batched: "continuous" or "static" (None: not generated).
    batching: str | None = None
    #: Requests tokenised by tokeniser actors (:mod:`rayeval.service.engine.plan.tokenisers`).
    tokenised_by_actors: int = 0
    #: Requests whose part a tokeniser actor planned.
    planned_by_actors: int = 0
    #: Generated answers a tokeniser actor decoded into lm-eval's text.
    decoded_by_actors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def real_token_fraction(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def replica_utilisation(self) -> dict[int, float]:
        """Per replica: the share of the phase's wall time its slowest rank spent computing."""
        if self.seconds <= 0:
            return {}
        return {r: busy / self.seconds for r, busy in sorted(self.replica_busy_s.items())}

    def report(self) -> dict[str, Any]:
        """The figures as plain data (for logs, JSON and the CLI)."""
        return {
            "requests": self.requests,
            "cached": self.cached,
            "recomputed": self.recomputed,
            "requeued": self.requeued,
            "micro_batches": self.micro_batches,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "real_token_fraction": self.real_token_fraction,
            "replica_utilisation": self.replica_utilisation,
            **({"batching": self.batching} if self.batching else {}),
            **({"tokenised_by_actors": n} if (n := self.tokenised_by_actors) else {}),
            **({"planned_by_actors": n} if (n := self.planned_by_actors) else {}),
            **({"decoded_by_actors": n} if (n := self.decoded_by_actors) else {}),
        }


@dataclass(frozen=True)
class StartUp:
    """The engine's start-up, reported with every progress: the slowest rank's model load
    (0 on kept ranks) and the seconds from the engine's start to its first batch."""

    load_s: float | None
    startup_s: float | None


class PhaseTracker:
    """Follows one run of a request type's micro-batches.

    Args:
        phase: The request type.
        stats: Its figures so far (this run adds to them).
        requests_per_micro_batch: How many requests each micro-batch answers.
        replicas: The replicas' numbers (idle ones report zero work, not nothing).
        rank_memory: Per replica, its ranks' memory after their last micro-batch (shared by
            every phase of the evaluation, updated here).
        start: The engine's start-up figures.
        on_progress: Called with the request type's progress after every step.
        disable_tqdm: No progress bar.
        expected: Requests of the run when its micro-batches come in parts (:meth:`expect`).
        answered: Requests of the run the response cache answered: they count as done (and
            in the total) from the start.
    """

    def __init__(
        self,
        phase: str,
        stats: PhaseStats,
        requests_per_micro_batch: Counter[int],
        replicas: range,
        rank_memory: dict[str, list[RankMemory]],
        start: StartUp,
        on_progress: Callable[[Progress], None] | None,
        disable_tqdm: bool,
        expected: int | None = None,
        answered: int = 0,
    ) -> None:
        self._phase = phase
        self._stats = stats
        self._counts = requests_per_micro_batch
        self._rank_memory = rank_memory
        self._start = start
        self._on_progress = on_progress
        computed = sum(requests_per_micro_batch.values()) if expected is None else expected
        stats.requests += computed
        self.total = computed + answered
        self.done = answered
        for replica in replicas:
            stats.replica_busy_s.setdefault(replica, 0.0)
        self._started = time.monotonic()
        self._base_seconds = stats.seconds
        #: (requests done, when) at the last progress report.
        self._reported: tuple[int, float] | None = None
        stream = progress_stream()
        self._bar = tqdm(
            initial=self.done,
            total=self.total,
            desc=f"rayeval {phase}",
            disable=disable_tqdm,
            unit="req",
            file=stream,
            mininterval=redraw_every_s(stream),  # in a log, each redraw is a line
        )

    def expect(self, requests_per_micro_batch: Counter[int], answered: int) -> None:
        """Micro-batches of the next part of the run, and how many of the expected requests
        were answered without computing (they are done at once)."""
        self._counts.update(requests_per_micro_batch)
        self._stats.requests -= answered
        if answered:
            self.done += answered
            self._moved(answered)

    def step(self, step: StepDone) -> None:
        """Add a finished step's figures and report progress."""
        stats = self._stats
        count = sum(self._counts[i] for i in step.micro_batches)
        real = sum(s.real_tokens for s in step.stats)
        self.done += count
        stats.real_tokens += real
        stats.padded_tokens += sum(s.padded_tokens for s in step.stats)
        replica = step.replica
        stats.replica_busy_s[replica] += max(s.seconds for s in step.stats)
        stats.replica_requests[replica] = stats.replica_requests.get(replica, 0) + count
        stats.replica_tokens[replica] = stats.replica_tokens.get(replica, 0) + real
        self._rank_memory[str(replica)] = [
            RankMemory(rss_mib=s.rss_mib, device_mib=s.device_mib) for s in step.stats
        ]
        self._moved(count)

    def piece(self, piece: PieceDone) -> None:
        """Add a streamed piece's figures (its requests finished) and report progress.

        Under FSDP a replica's ranks each stream their own group, in lockstep: their tokens add
        up, and the replica's busy time is its first rank's.
        """
        stats = self._stats
        replica, count = piece.replica, len(piece.finished)
        self.done += count
        stats.real_tokens += piece.stats.real_tokens
        stats.padded_tokens += piece.stats.padded_tokens
        if piece.shard_rank == 0:
            stats.replica_busy_s[replica] = stats.replica_busy_s.get(replica, 0.0) + (
                piece.stats.seconds
            )
        stats.replica_requests[replica] = stats.replica_requests.get(replica, 0) + count
        stats.replica_tokens[replica] = (
            stats.replica_tokens.get(replica, 0) + piece.stats.real_tokens
        )
        ranks = self._rank_memory.setdefault(str(replica), [])
        ranks.extend(
            RankMemory(rss_mib=0.0, device_mib=0.0)
            for _ in range(piece.shard_rank + 1 - len(ranks))
        )
        ranks[piece.shard_rank] = RankMemory(
            rss_mib=piece.stats.rss_mib, device_mib=piece.stats.device_mib
        )
        self._moved(count)

    def _moved(self, count: int) -> None:
        """The phase's seconds so far, the bar, and a progress report when one is due."""
        stats = self._stats
        now = time.monotonic()
        stats.seconds = self._base_seconds + now - self._started
        self._bar.update(count)
        self._bar.set_postfix(
            tok_s=f"{stats.tokens_per_s:,.0f}",
            real=f"{stats.real_token_fraction:.2f}",
            refresh=False,
        )
        if self._on_progress is not None and self._report_due(now):
            self._reported = (self.done, now)
            self._on_progress(self.progress())

    def _report_due(self, now: float) -> bool:
        """The first and last moves are reported, and in between a move of at least
        :data:`REPORT_SHARE` of the requests or :data:`REPORT_EVERY_S` after the last report:
        a report per step would cost the driver more than the step at many replicas."""
        if self._reported is None or self.done >= self.total:
            return True
        done, at = self._reported
        return self.done - done >= self.total * REPORT_SHARE or now - at >= REPORT_EVERY_S

    def progress(self) -> Progress:
        """The request type's progress as it stands."""
        stats = self._stats
        return Progress(
            phase=self._phase,
            done=self.done,
            total=self.total,
            tokens_per_s=stats.tokens_per_s,
            real_token_fraction=stats.real_token_fraction,
            seconds=stats.seconds,
            cached=stats.cached,
            replicas={
                str(r): ReplicaWork(
                    requests=stats.replica_requests.get(r, 0),
                    tokens=stats.replica_tokens.get(r, 0),
                    busy_s=busy_s,
                )
                for r, busy_s in sorted(stats.replica_busy_s.items())
            },
            rank_memory=dict(self._rank_memory),
            load_s=self._start.load_s,
            startup_s=self._start.startup_s,
        )

    def report(self) -> None:
        """Report the progress as it stands (a run the response cache answered whole)."""
        if self._on_progress is not None:
            self._reported = (self.done, time.monotonic())
            self._on_progress(self.progress())

    def close(self) -> None:
        """Close the progress bar."""
        self._bar.close()
