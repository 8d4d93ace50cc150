"""Prometheus metrics of the service, read from the database at scrape time.

Nothing is counted in this process: every figure comes from what the runners reported and the
store kept (an evaluation's stored progress: per request type its counts, seconds, tokens, cache
hits, per-replica work and per-rank memory; see
:class:`rayeval.service.vocabulary.events.Progress`). A scrape therefore gives the same answer from
any API process over the same database, and a restarted server loses nothing. Per-evaluation series
exist while the evaluation is starting or running (Prometheus keeps their history); counts by state
cover every evaluation.

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

from rayeval.service.jobs.store import EvaluationRecord, EvaluationStore
from rayeval.service.vocabulary.events import PhaseReport
from rayeval.service.vocabulary.states import EvaluationStatus

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


_EVALUATION = ("evaluation",)
_PHASE = ("evaluation", "request_type")
_REPLICA = ("evaluation", "request_type", "replica")
_RANK = ("evaluation", "replica", "shard_rank")
#: Every family: attribute -> (metric name, help, labels), in the order a scrape lists them.
_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "evaluations": ("rayeval_evaluations", "Evaluations in each state.", ("state",)),
    "queue_length": ("rayeval_queue_length", "Evaluations waiting for room on the cluster.", ()),
    "done": (
        "rayeval_evaluation_requests_done",
        "Requests computed so far (answers from the response cache not included).",
        _PHASE,
    ),
    "planned": (
        "rayeval_evaluation_requests_planned",
        "Requests to compute for this request type (known once it starts).",
        _PHASE,
    ),
    "requests_per_s": (
        "rayeval_evaluation_requests_per_second",
        "Requests computed per second of this request type.",
        _PHASE,
    ),
    "tokens_per_s": (
        "rayeval_evaluation_tokens_per_second",
        "Real (non-padding) tokens computed per second of this request type.",
        _PHASE,
    ),
    "eta": (
        "rayeval_evaluation_eta_seconds",
        "Seconds left for this request type at its rate so far.",
        _PHASE,
    ),
    "real_tokens": (
        "rayeval_evaluation_real_token_ratio",
        "Real tokens / padded tokens computed (padding efficiency).",
        _PHASE,
    ),
    "cache_hits": (
        "rayeval_evaluation_cache_hits",
        "Requests answered from the response cache instead of computed.",
        _PHASE,
    ),
    "replica_requests": (
        "rayeval_replica_requests_per_second",
        "Requests one replica computed per second of this request type.",
        _REPLICA,
    ),
    "replica_tokens": (
        "rayeval_replica_tokens_per_second",
        "Real tokens one replica computed per second of this request type.",
        _REPLICA,
    ),
    "utilisation": (
        "rayeval_replica_utilisation_ratio",
        "Share of the request type's wall time the replica's slowest rank spent computing.",
        _REPLICA,
    ),
    "rss": (
        "rayeval_rank_resident_memory_bytes",
        "Resident memory of a rank's process after its last micro-batch.",
        _RANK,
    ),
    "device_memory": (
        "rayeval_rank_device_memory_bytes",
        "Device (CUDA) memory held by a rank's tensors after its last micro-batch.",
        _RANK,
    ),
    "load": (
        "rayeval_evaluation_load_seconds",
        "Seconds the slowest rank took to load its shard of the model.",
        _EVALUATION,
    ),
    "startup": (
        "rayeval_evaluation_startup_seconds",
        "Seconds from the engine's start (reserving ranks) to its first batch.",
        _EVALUATION,
    ),
}


class _Families:
    """One empty family per metric of :data:`_FAMILIES`, filled by the collector."""

    evaluations: GaugeMetricFamily
    queue_length: GaugeMetricFamily
    done: GaugeMetricFamily
    planned: GaugeMetricFamily
    requests_per_s: GaugeMetricFamily
    tokens_per_s: GaugeMetricFamily
    eta: GaugeMetricFamily
    real_tokens: GaugeMetricFamily
    cache_hits: GaugeMetricFamily
    replica_requests: GaugeMetricFamily
    replica_tokens: GaugeMetricFamily
    utilisation: GaugeMetricFamily
    rss: GaugeMetricFamily
    device_memory: GaugeMetricFamily
    load: GaugeMetricFamily
    startup: GaugeMetricFamily

    def __init__(self) -> None:
        for attribute, (name, documentation, labels) in _FAMILIES.items():
            setattr(self, attribute, GaugeMetricFamily(name, documentation, labels=list(labels)))

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
    # Progress counts the cache's answers as done; these series count what the ranks compute.
    families.done.add_metric(labels, p.done - p.cached)
    families.planned.add_metric(labels, p.total - p.cached)
    families.tokens_per_s.add_metric(labels, p.tokens_per_s)
    families.real_tokens.add_metric(labels, p.real_token_fraction)
    families.cache_hits.add_metric(labels, p.cached)
    if p.seconds <= 0:
        return
    rate = p.requests_per_s
    families.requests_per_s.add_metric(labels, rate)
    if rate > 0:
        families.eta.add_metric(labels, (p.total - p.done) / rate)
    for replica, work in p.replicas.items():
        replica_labels = [*labels, str(replica)]
        families.replica_requests.add_metric(replica_labels, work.requests / p.seconds)
        families.replica_tokens.add_metric(replica_labels, work.tokens / p.seconds)
        families.utilisation.add_metric(replica_labels, work.busy_s / p.seconds)
