"""How big the planners may make a micro-batch or a continuous-batching group, from the
evaluation's configuration (and, for the KV cache on GPUs, the device's memory): the same for
every layout of one cluster, so plans never depend on R or G."""

from __future__ import annotations

from typing import Any

from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind
from rayeval.service.config import (
    DEFAULT_CPU_SCORE_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BATCH_TOKENS,
    EngineConfig,
)
from rayeval.service.engine.generation_planner import SlotBudget
from rayeval.service.engine.planner import TokenBudget


def slot_budget(
    config: EngineConfig, device: DeviceKind, group: WorkerGroup | None, shell: Any
) -> SlotBudget:
    """The continuous-batching engine's slots and KV-cache budget, from the configuration
    (and on GPUs the device's memory: the same for every layout of one cluster).

    Args:
        config: The evaluation's engine configuration.
        device: What the ranks hold.
        group: The ranks (their device memory), or None.
        shell: The model on the meta device (its KV-cache bytes per token), or None.
    """
    slots = config.batch_size if isinstance(config.batch_size, int) else None
    slots = slots or config.max_batch_size or DEFAULT_MAX_BATCH_ROWS
    if config.kv_cache_tokens:
        return SlotBudget(slots, config.kv_cache_tokens, "--kv_cache_tokens")
    if config.max_batch_tokens:
        return SlotBudget(slots, config.max_batch_tokens, "--max_batch_tokens")
    derived = _kv_tokens_from_memory(device, group, shell)
    return SlotBudget(slots, derived or DEFAULT_MAX_BATCH_TOKENS, "--kv_cache_tokens")


def _kv_tokens_from_memory(device: DeviceKind, group: WorkerGroup | None, shell: Any) -> int | None:
    """On GPUs: the KV-cache positions half the device memory left beside the whole model
    holds (the whole model, whatever G: the budget must not depend on the layout)."""
    if device is not DeviceKind.CUDA or group is None or shell is None:
        return None
    reports = group.wait_ready()
    totals = [float(r["device_total_mib"]) for r in reports if r.get("device_total_mib")]
    if not totals or len(totals) < len(reports):
        return None
    from rayeval.actors.profiles import ModelShape

    itemsize = shell.dtype.itemsize
    per_token = ModelShape(shell.config).kv_bytes_per_token(itemsize)
    free = min(totals) * 2**20 * 0.9 - shell.num_parameters() * itemsize
    if per_token <= 0 or free <= 0:
        return None
    return max(1, int(free * 0.5 // per_token))


def budget(config: EngineConfig, score_on: DeviceKind | None = None) -> TokenBudget:
    """Micro-batch limits: a token budget with ``auto``, lm-eval's rows per batch otherwise.

    ``score_on``: the budget of scoring micro-batches on ranks of that device. CPU ranks score
    with a smaller default token budget than GPUs: a CPU forward over 1-2k tokens runs faster
    per token than one over 4-8k, whose activations outgrow the caches (measured in
    docs/performance.md), and narrower micro-batches pad less. Generation keeps the larger
    budget on every device: each decode step costs a forward of one token per row, and under
    FSDP one all-gather of every weight for the whole micro-batch, so wider is faster.
    """
    if isinstance(config.batch_size, str):  # "auto" or "auto:N" (validated by the config)
        default = DEFAULT_MAX_BATCH_TOKENS
        if score_on is DeviceKind.CPU:
            default = DEFAULT_CPU_SCORE_BATCH_TOKENS
        return TokenBudget(
            max_tokens=config.max_batch_tokens or default,
            max_rows=config.max_batch_size or DEFAULT_MAX_BATCH_ROWS,
        )
    return TokenBudget(max_tokens=config.max_batch_tokens or 2**62, max_rows=config.batch_size)
