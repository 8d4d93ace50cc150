"""A checkpoint sweep's summary: per checkpoint its step, outcome, metrics and timings; as JSON
(``sweep.json`` beside the per-checkpoint results) and as a plain-text table.

No torch, no Ray: the CLI (``rayeval results``), the service and the dashboard read it. Each
checkpoint's metrics are lm-eval's own entries of its results file (``results`` and ``groups``:
``"acc,none"``, ``"acc_stderr,none"``, ...), copied as they are.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The summary's file name under the sweep's output path.
SUMMARY_FILE = "sweep.json"
#: What ``kind`` a summary file says it is.
KIND = "rayeval-sweep"

_STDERR = "_stderr,"


@dataclass
class CheckpointRecord:
    """One checkpoint of a sweep.

    Args:
        checkpoint: Its path (absolute).
        label: Its name in file names and tables (unique within the sweep).
        step: Its training step (``trainer_state.json``'s ``global_step``, else its name's last
            number), if any.
        status: ``succeeded``, ``refused`` (it did not fit the model: ``error`` says why),
            ``failed`` or ``skipped`` (evaluated before, by a results file or the response cache).
        fingerprint: Its weights' fingerprint (the response cache's key for it).
        results_file: Its lm-eval results file, relative to the sweep's output path.
        results: lm-eval's ``results`` and ``groups`` entries, by task or group.
        higher_is_better: lm-eval's ``higher_is_better``, by task or group.
        seconds: ``swap`` (checking and reading its weights; for the first, starting the
            ranks), ``read`` (the slowest rank's part of that: reading its slices, or for the
            first its whole load), ``compute`` (the ranks' request types), ``evaluate``
            (lm-eval's whole evaluation, compute included), ``save`` and ``total``.
        error: Why it was refused or failed.
        kind: ``weights`` (a checkpoint of the model) or ``adapter`` (a LoRA adapter applied
            to the sweep's model, as ``peft=``).
        stats: The engine's figures per request type for this checkpoint (as a single
            evaluation's ``stats``: requests, answers from the response cache, ...).
    """

    checkpoint: str
    label: str
    step: int | None
    status: str
    fingerprint: str | None = None
    results_file: str | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    higher_is_better: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    kind: str = "weights"
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class SweepSummary:
    """A sweep: the model, the tasks, and one record per checkpoint in evaluation order."""

    model: str
    tasks: list[str]
    checkpoints: list[CheckpointRecord] = field(default_factory=list)

    def add(self, record: CheckpointRecord) -> None:
        """Record a checkpoint (a later record of the same checkpoint replaces the earlier)."""
        self.checkpoints = [r for r in self.checkpoints if r.checkpoint != record.checkpoint]
        self.checkpoints.append(record)

    def by_step(self) -> list[CheckpointRecord]:
        """The records ordered by training step (no step last, then by label)."""
        return sorted(self.checkpoints, key=lambda r: (r.step is None, r.step or 0, r.label))

    def to_json(self) -> dict[str, Any]:
        """The summary as plain data (what ``sweep.json`` holds)."""
        return {
            "kind": KIND,
            "model": self.model,
            "tasks": list(self.tasks),
            "checkpoints": [asdict(record) for record in self.checkpoints],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepSummary:
        """A summary from :meth:`to_json`'s form.

        Raises:
            ValueError: ``data`` is not a sweep summary.
        """
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise ValueError('not a rayeval sweep summary (no "kind": "rayeval-sweep")')
        return cls(
            model=str(data["model"]),
            tasks=[str(t) for t in data["tasks"]],
            checkpoints=[CheckpointRecord(**record) for record in data["checkpoints"]],
        )

    def write(self, directory: Path) -> Path:
        """Write ``sweep.json`` under ``directory`` (atomically); returns its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / SUMMARY_FILE
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.to_json(), indent=2, default=str), encoding="utf-8")
        partial.replace(path)
        return path


#: The figures of :attr:`CheckpointRecord.stats` that add up over checkpoints.
_COUNTS = (
    "requests",
    "cached",
    "recomputed",
    "requeued",
    "micro_batches",
    "real_tokens",
    "padded_tokens",
)


def total_stats(records: list[CheckpointRecord]) -> dict[str, dict[str, Any]]:
    """The sweep's figures per request type, summed over its checkpoints: the counts of
    :data:`_COUNTS` and the seconds (what a sweep's evaluation reports as its ``stats``)."""
    totals: dict[str, dict[str, Any]] = {}
    for record in records:
        for phase, figures in record.stats.items():
            total = totals.setdefault(phase, {name: 0 for name in _COUNTS} | {"seconds": 0.0})
            for name in (*_COUNTS, "seconds"):
                total[name] += figures.get(name) or 0
    return totals


def read_summary(path: str | Path) -> SweepSummary:
    """The summary in ``path`` (a ``sweep.json`` file, or the sweep's output directory).

    Raises:
        FileNotFoundError: no summary there.
        ValueError: the file is not a sweep summary.
    """
    location = Path(path)
    if location.is_dir():
        location = location / SUMMARY_FILE
    return SweepSummary.from_json(json.loads(location.read_text(encoding="utf-8")))


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's ``results`` and ``groups`` entries of a results dict, by task or group."""
    found: dict[str, dict[str, Any]] = {}
    for section in ("results", "groups"):
        for name, entries in (results.get(section) or {}).items():
            found[name] = {key: value for key, value in entries.items() if key != "alias"}
    return found


def table(summary: SweepSummary) -> str:
    """The sweep as a plain-text table: a row per task and metric, a column per checkpoint in
    step order (``value ± stderr``); then why any checkpoint was refused, failed or skipped."""
    records = summary.by_step()
    rows: list[tuple[str, str]] = []
    for record in records:
        for name, entries in record.results.items():
            for key, value in entries.items():
                metric = "," in key and _STDERR not in key and _number(value)
                if metric and (name, key) not in rows:
                    rows.append((name, key))
    lines = [["Tasks", "Metric", *(record.label for record in records)]]
    for name, key in rows:
        lines.append([name, _metric(key), *(_cell(r.results.get(name, {}), key) for r in records)])
    if not rows:
        lines.append(["", "", *(record.status for record in records)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in lines
    ]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text += [
        f"{record.label}: {record.status}" + (f": {record.error}" if record.error else "")
        for record in records
        if record.status != "succeeded"
    ]
    return "\n".join(text)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _metric(key: str) -> str:
    metric, _, filter_name = key.partition(",")
    return metric if filter_name in ("", "none") else f"{metric} ({filter_name})"


def _cell(entries: dict[str, Any], key: str) -> str:
    value = entries.get(key)
    if not _number(value):
        return ""
    metric, _, filter_name = key.partition(",")
    stderr = entries.get(f"{metric}_stderr,{filter_name}")
    text = f"{value:.4f}"
    if isinstance(stderr, int | float) and not math.isnan(stderr):
        text += f" ± {stderr:.4f}"
    return text
