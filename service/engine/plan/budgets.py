"""How big the planners may make a micro-batch or a continuous-batching group, from the
evaluation's configuration, so plans never depend on R or G (the device's memory only bounds how
much of a continuous-batching group runs at once)."""

from __future__ import annotations

from collections.abc import Sequence

from rayeval.actors.batches import head_chunk_rows
from rayeval.actors.errors import field
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind
from rayeval.service.engine.plan.generation_planner import MEMORY_SETTING, SlotBudget
from rayeval.service.engine.plan.planner import TokenBudget
from rayeval.service.vocabulary.config import (
    DEFAULT_CPU_SCORE_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BATCH_TOKENS,
    EngineConfig,
)


def slot_budget(config: EngineConfig, group: WorkerGroup | None) -> SlotBudget:
    """The continuous-batching engine's slots and KV-cache budget.

    The plan is fixed by the requests and settings alone (invariant 2): ``--kv_cache_tokens``
    or ``--max_batch_tokens`` when given, else the slots alone bound a group (each group may
    hold its ``slots`` rows as long as its largest request). Memory only decides how much of
    that runs at once: where a rank says that its device holds fewer KV-cache positions now
    (asked for every plan; GPUs: ``torch.cuda.mem_get_info`` plus what the caching allocator
    holds free, less the logits set aside), the fewest bound the groups, and a request that
    needs more than that is refused before it runs. Prefill waves are capped by the
    micro-batch token budget.

    Args:
        config: The evaluation's engine configuration.
        group: The ranks (asked for the KV-cache positions their memory holds), or None.
    """
    slots = generation_slots(config)
    prefill = config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    if config.kv_cache_tokens:
        return SlotBudget(slots, config.kv_cache_tokens, field("kv_cache_tokens"), prefill)
    if config.max_batch_tokens:
        return SlotBudget(slots, config.max_batch_tokens, field("max_batch_tokens"), prefill)
    held = None
    if group is not None:
        held = memory_kv_tokens(group.kv_capacity_tokens(config.timeouts.control_s))
    if held is None:
        return SlotBudget(slots, None, field("kv_cache_tokens"), prefill)
    return SlotBudget(slots, held, MEMORY_SETTING, prefill)


def generation_slots(config: EngineConfig) -> int:
    """Rows a continuous-batching group computes at once: ``batch_size`` when it is a number,
    else ``max_batch_size``, else :data:`DEFAULT_MAX_BATCH_ROWS`."""
    slots = config.batch_size if isinstance(config.batch_size, int) else None
    return slots or config.max_batch_size or DEFAULT_MAX_BATCH_ROWS


def picked_budgets(config: EngineConfig, score_on: DeviceKind, vocab: int) -> str:
    """What the micro-batch limits are for this evaluation, in words (the run's first lines):
    the token and row budgets, the output head's chunk at the model's vocabulary, the slots."""
    score = budget(config, score_on)
    chunk = head_chunk_rows(vocab, config.logits_budget_mib * 2**20) if vocab else None
    head = (
        f"the output head over at most {chunk} scored positions at a time "
        f"({config.logits_budget_mib} MiB of logits at a vocabulary of {vocab:,})"
        if chunk
        else "the output head over every scored position at once (the vocabulary is not known)"
    )
    tokens = "any number of tokens" if score.max_tokens >= 2**62 else f"{score.max_tokens:,} tokens"
    return (
        f"batch_size {config.batch_size}: scoring micro-batches of {tokens} and "
        f"{score.max_rows} rows at most, {head}; generation in groups of "
        f"{generation_slots(config)} rows"
    )


def memory_kv_tokens(held: Sequence[int | None]) -> int | None:
    """The fewest KV-cache positions a rank's free memory holds (each rank's, None where it does
    not say), or None when no rank says."""
    said = [tokens for tokens in held if tokens is not None]
    return min(said) if said else None


def budget(config: EngineConfig, score_on: DeviceKind | None = None) -> TokenBudget:
    """Micro-batch limits: a token budget with ``auto``, lm-eval's rows per batch otherwise.

    ``score_on``: the budget of scoring micro-batches on ranks of that device. CPU ranks score
    with a smaller default token budget than GPUs: a CPU forward over 1-2k tokens runs faster
    per token than one over 4-8k, whose activations outgrow the caches (measured in
    docs/performance-notes.md), and narrower micro-batches pad less. Generation keeps the larger
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
