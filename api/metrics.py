"""Prometheus metrics of the service, read from the database at scrape time.

Nothing is counted in this process: every figure comes from what the runners reported and the
store kept (an evaluation's stored progress: per request type its counts, seconds, tokens, cache
hits, per-replica work and per-rank memory; see :class:`rayeval.service.events.Progress`). A
scrape therefore gives the same answer from any API process over the same database, and a restarted
server loses nothing. Per-evaluation series exist while the evaluation is starting or running
(Prometheus keeps their history); counts by state cover every evaluation.

Families (``evaluation`` is the evaluation id, ``request_type`` lm-eval's request type):

- ``rayeval_evaluations{state}``, ``rayeval_queue_length``
- ``rayeval_evaluation_requests_done`` / ``_requests_planned`` / ``_requests_per_second`` /
  ``_tokens_per_second`` / ``_eta_seconds`` / ``_real_token_ratio`` / ``_cache_hits``
  ``{evaluation, request_type}``
- ``rayeval_replica_requests_per_second`` / ``_tokens_per_second`` / ``_utilisation_ratio``
  ``{evaluation, request_type, replica}``
- ``rayeval_rank_resident_memory_bytes`` / ``rayeval_rank_device_memory_bytes``
  ``{evaluation, replica, shard_rank}``
- ``rayeval_evaluation_load_seconds`` / ``rayeval_evaluation_startup_seconds{evaluation}``
- the API process's own ``process_*`` figures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rayeval.service.events import PhaseReport
from rayeval.service.jobs.states import EvaluationStatus
from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore

_MIB = 2**20


def build_registry(store: EvaluationStore) -> CollectorRegistry:
    """A registry with the service's collector and the API process's own figures."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ServiceCollector(store))
    ProcessCollector(registry=registry)
    return registry


class ServiceCollector(Collector):
    """Collects the service's metrics from ``store`` on every scrape."""

    def __init__(self, store: EvaluationStore) -> None:
        self._store = store

    def describe(self) -> list[Metric]:
        return list(_Families().all())  # names and types, without reading the database

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        counts = self._store.count_by_status()
        for status in EvaluationStatus:
            families.evaluations.add_metric([status.value], counts.get(status, 0))
        families.queue_length.add_metric([], counts.get(EvaluationStatus.QUEUED, 0))
        for record in self._store.active():
            _add_evaluation(families, record)
        yield from families.all()


class _Families:
    """One empty family per metric, filled by the collector."""

    def __init__(self) -> None:
        evaluation = ["evaluation"]
        phase = ["evaluation", "request_type"]
        replica = ["evaluation", "request_type", "replica"]
        rank = ["evaluation", "replica", "shard_rank"]
        self.evaluations = GaugeMetricFamily(
            "rayeval_evaluations", "Evaluations in each state.", labels=["state"]
        )
        self.queue_length = GaugeMetricFamily(
            "rayeval_queue_length", "Evaluations waiting for room on the cluster."
        )
        self.done = GaugeMetricFamily(
            "rayeval_evaluation_requests_done",
            "Requests computed so far (answers from the response cache not included).",
            labels=phase,
        )
        self.planned = GaugeMetricFamily(
            "rayeval_evaluation_requests_planned",
            "Requests to compute for this request type (known once it starts).",
            labels=phase,
        )
        self.requests_per_s = GaugeMetricFamily(
            "rayeval_evaluation_requests_per_second",
            "Requests computed per second of this request type.",
            labels=phase,
        )
        self.tokens_per_s = GaugeMetricFamily(
            "rayeval_evaluation_tokens_per_second",
            "Real (non-padding) tokens computed per second of this request type.",
            labels=phase,
        )
        self.eta = GaugeMetricFamily(
            "rayeval_evaluation_eta_seconds",
            "Seconds left for this request type at its rate so far.",
            labels=phase,
        )
        self.real_tokens = GaugeMetricFamily(
            "rayeval_evaluation_real_token_ratio",
            "Real tokens / padded tokens computed (padding efficiency).",
            labels=phase,
        )
        self.cache_hits = GaugeMetricFamily(
            "rayeval_evaluation_cache_hits",
            "Requests answered from the response cache instead of computed.",
            labels=phase,
        )
        self.replica_requests = GaugeMetricFamily(
            "rayeval_replica_requests_per_second",
            "Requests one replica computed per second of this request type.",
            labels=replica,
        )
        self.replica_tokens = GaugeMetricFamily(
            "rayeval_replica_tokens_per_second",
            "Real tokens one replica computed per second of this request type.",
            labels=replica,
        )
        self.utilisation = GaugeMetricFamily(
            "rayeval_replica_utilisation_ratio",
            "Share of the request type's wall time the replica's slowest rank spent computing.",
            labels=replica,
        )
        self.rss = GaugeMetricFamily(
            "rayeval_rank_resident_memory_bytes",
            "Resident memory of a rank's process after its last micro-batch.",
            labels=rank,
        )
        self.device_memory = GaugeMetricFamily(
            "rayeval_rank_device_memory_bytes",
            "Device (CUDA) memory held by a rank's tensors after its last micro-batch.",
            labels=rank,
        )
        self.load = GaugeMetricFamily(
            "rayeval_evaluation_load_seconds",
            "Seconds the slowest rank took to load its shard of the model.",
            labels=evaluation,
        )
        self.startup = GaugeMetricFamily(
            "rayeval_evaluation_startup_seconds",
            "Seconds from the engine's start (reserving ranks) to its first batch.",
            labels=evaluation,
        )

    def all(self) -> Iterator[Metric]:
        yield from (v for v in vars(self).values() if isinstance(v, GaugeMetricFamily))


def _add_evaluation(families: _Families, record: EvaluationRecord) -> None:
    """The series of one active evaluation, from its stored progress."""
    for phase, p in record.progress.phases.items():
        _add_phase(families, [record.id, phase], p)
    latest = record.progress.latest()
    if latest is None:
        return
    for replica, ranks in latest.rank_memory.items():
        for shard_rank, memory in enumerate(ranks):
            rank_labels = [record.id, str(replica), str(shard_rank)]
            families.rss.add_metric(rank_labels, memory.rss_mib * _MIB)
            families.device_memory.add_metric(rank_labels, memory.device_mib * _MIB)
    if latest.load_s is not None:
        families.load.add_metric([record.id], latest.load_s)
    if latest.startup_s is not None:
        families.startup.add_metric([record.id], latest.startup_s)


def _add_phase(families: _Families, labels: list[str], p: PhaseReport) -> None:
    """The series of one request type of an evaluation (``labels``: evaluation, request type)."""
    families.done.add_metric(labels, p.done)
    families.planned.add_metric(labels, p.total)
    families.tokens_per_s.add_metric(labels, p.tokens_per_s)
    families.real_tokens.add_metric(labels, p.real_token_fraction)
    families.cache_hits.add_metric(labels, p.cached)
    if p.seconds <= 0:
        return
    rate = p.done / p.seconds
    families.requests_per_s.add_metric(labels, rate)
    if rate > 0:
        families.eta.add_metric(labels, (p.total - p.done) / rate)
    for replica, work in p.replicas.items():
        replica_labels = [*labels, str(replica)]
        families.replica_requests.add_metric(replica_labels, work.requests / p.seconds)
        families.replica_tokens.add_metric(replica_labels, work.tokens / p.seconds)
        families.utilisation.add_metric(replica_labels, work.busy_s / p.seconds)
