"""Planning generation: tokenised generate_until requests in, layout-independent batches out.

Requests are grouped by their generation settings (lm-eval groups by gen_kwargs), each group
sorted longest first, as lm-eval sorts, and cut by the budget alone: into static micro-batches
(:func:`plan_generate`: a token budget, generation room included) or into continuous-batching
groups (:func:`plan_generate_groups`: ``slots x REQUESTS_PER_SLOT`` requests each). Sampled
requests draw from generators seeded per request (:class:`Seeder`). Nothing here depends on R, G
or timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayeval.actors.batches import GenerateGroup, GenerateMicroBatch, SlotRequest
from rayeval.actors.errors import ConfigError, in_flags
from rayeval.actors.errors import field as config_field
from rayeval.service.engine.plan.planner import TokenBudget, cut_by_budget

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateRequest:
    """One generate_until request, already tokenised and truncated (by the driver, whose
    contexts are tuples, or by a tokeniser actor, whose contexts the driver holds as the
    ``array('i')`` it received: equal ids sort, key and seed alike either way)."""

    context: tuple[int, ...] | array[int]
    max_gen_toks: int
    until: tuple[str, ...]
    max_length: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Every generation setting of the request (what its answer depends on besides the
        context)."""
        return {
            "max_gen_toks": self.max_gen_toks,
            "until": list(self.until),
            "max_length": self.max_length,
            "kwargs": self.kwargs,
        }

    def config_key(self) -> str:
        """Requests with equal keys may share a ``generate`` call (lm-eval groups by gen_kwargs)."""
        return json.dumps(
            [self.max_gen_toks, self.until, self.max_length, self.kwargs],
            sort_keys=True,
            default=str,
        )


@dataclass(frozen=True)
class GeneratePlan:
    """Micro-batches to generate and, per request, (micro-batch, position in it)."""

    micro_batches: list[GenerateMicroBatch]
    locations: list[tuple[int, int]]


def plan_generate(requests: Sequence[GenerateRequest], budget: TokenBudget) -> GeneratePlan:
    """Group generate requests by their generation settings, sort by length, cut by budget."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.config_key(), []).append(index)

    micro_batches: list[GenerateMicroBatch] = []
    locations: list[tuple[int, int]] = [(-1, -1)] * len(requests)
    for indices in groups.values():
        indices.sort(key=lambda i: _longest_first(requests[i].context))
        first = requests[indices[0]]
        for chunk in cut_by_budget(
            indices,
            budget,
            width=lambda i, room=first.max_gen_toks: len(requests[i].context) + room,
        ):
            for position, index in enumerate(chunk):
                locations[index] = (len(micro_batches), position)
            micro_batches.append(
                GenerateMicroBatch(
                    contexts=tuple(requests[i].context for i in chunk),
                    max_gen_toks=first.max_gen_toks,
                    until=first.until,
                    max_length=first.max_length,
                    kwargs=dict(first.kwargs),
                )
            )
    return GeneratePlan(micro_batches, locations)


#: How an error names the KV-cache bound that the ranks' free memory sets (after "raise").
MEMORY_SETTING = (
    "the device memory each rank has free after loading "
    f"(a larger {config_field('parallelism', 'shard_size')})"
)

#: A continuous-batching group holds this many requests per slot: enough that refilled slots stay
#: busy for most of the group, few enough that replicas share the work.
REQUESTS_PER_SLOT = 4


@dataclass(frozen=True)
class SlotBudget:
    """How a rank's continuous-batching engine may hold requests.

    Args:
        slots: Most rows decoded together.
        kv_tokens: Most KV-cache positions held together (a request holds its context plus
            its ``max_gen_toks``), or None: as many as the slots' requests need.
        setting: What sets ``kv_tokens``, for error messages: an option, or the device memory.
        prefill_tokens: Most positions one prefill wave feeds, or None for no bound.
    """

    slots: int
    kv_tokens: int | None
    setting: str = config_field("max_batch_tokens")
    prefill_tokens: int | None = None

    def slots_need(self, needs: Sequence[int]) -> int:
        """The KV-cache positions a group of requests needing ``needs`` holds at most when only
        its slots bound it: its slots' rows, each as long as its largest request (the rows'
        caches are one cache, left-padded to the longest row)."""
        return min(self.slots, len(needs)) * max(needs, default=0)


@dataclass(frozen=True)
class GroupPlan:
    """Groups to generate with continuous batching and, per request, (group, position in it)."""

    groups: list[GenerateGroup]
    locations: list[tuple[int, int]]


def plan_generate_groups(
    requests: Sequence[GenerateRequest],
    budget: SlotBudget,
    seeds: Sequence[int | None],
    names: Sequence[str] | None = None,
) -> GroupPlan:
    """Group generate requests by their settings, sort each longest first, and cut them into
    groups of ``slots x REQUESTS_PER_SLOT`` requests (never depending on the layout).

    Args:
        requests: Tokenised requests, in lm-eval's order.
        budget: The engine's slots and KV-cache budget.
        seeds: Per request, its sampling seed (None: greedy).
        names: Per request, how to name it in an error (task and document).

    Raises:
        ConfigError: a request needs more KV-cache positions than the budget holds.
    """
    check_fits(requests, budget, names)
    by_settings: dict[str, list[int]] = {}
    keys: dict[tuple[int, int | None], str] = {}  # requests sharing one kwargs dict: one key
    for index, request in enumerate(requests):
        seen = (id(request.kwargs), request.max_length)  # every request is alive: ids differ
        key = keys.get(seen)
        if key is None:
            key = json.dumps([request.max_length, request.kwargs], sort_keys=True, default=str)
            keys[seen] = key
        by_settings.setdefault(key, []).append(index)
    groups: list[GenerateGroup] = []
    locations: list[tuple[int, int]] = [(-1, -1)] * len(requests)
    size, bound = budget.slots * REQUESTS_PER_SLOT, 0
    for indices in by_settings.values():
        indices.sort(key=lambda i: _longest_first(requests[i].context))
        for start in range(0, len(indices), size):
            chunk = indices[start : start + size]
            for position, index in enumerate(chunk):
                locations[index] = (len(groups), position)
            slotted = tuple(_slot_request(requests[i], seeds[i]) for i in chunk)
            together = budget.slots_need([r.kv_tokens for r in slotted])
            kv_tokens = together if budget.kv_tokens is None else min(budget.kv_tokens, together)
            bound += kv_tokens < together
            groups.append(
                GenerateGroup(
                    requests=slotted,
                    slots=budget.slots,
                    kv_tokens=kv_tokens,
                    kwargs=dict(requests[chunk[0]].kwargs),
                    prefill_tokens=budget.prefill_tokens,
                )
            )
    if bound and budget.setting == MEMORY_SETTING:
        logger.warning(
            "%d of %d continuous-batching groups hold fewer rows at once than their slots: %s "
            "holds %d KV-cache positions per rank, so which rows decode together can differ "
            "between layouts. Set --kv_cache_tokens to fix the plan.",
            bound,
            len(groups),
            in_flags(budget.setting),
            budget.kv_tokens,
        )
    return GroupPlan(groups, locations)


def check_fits(
    requests: Sequence[GenerateRequest], budget: SlotBudget, names: Sequence[str] | None = None
) -> None:
    """Refuse a request that needs more KV-cache positions than ``budget`` holds.

    Raises:
        ConfigError: naming the first such request and the settings that make it fit.
    """
    if budget.kv_tokens is None:
        return
    for index, request in enumerate(requests):
        need = len(request.context) + request.max_gen_toks
        if need > budget.kv_tokens:
            name = names[index] if names else f"request {index}"
            raise ConfigError(
                f"{name} needs {need} KV-cache positions ({len(request.context)} context tokens "
                f"+ max_gen_toks {request.max_gen_toks}), more than the budget of "
                f"{budget.kv_tokens}: raise {budget.setting}, or lower max_gen_toks"
            )


def _longest_first(context: tuple[int, ...] | array[int]) -> tuple[int, Any]:
    """The sort key of a context: longest first, then by its ids. An ``array('i')``'s ids
    compare as their big-endian bytes, in the same order as the ints (an actor's are never
    negative, :meth:`~rayeval.service.engine.plan.tokenisers.Ragged.int32_arrays`), in C: comparing
    two arrays makes an int object per id up to the first that differs (few-shot prompts share
    hundreds)."""
    if not isinstance(context, array):
        return -len(context), context
    ordered = array("i", context)
    if sys.byteorder == "little":
        ordered.byteswap()
    return -len(context), ordered.tobytes()


def _slot_request(request: GenerateRequest, seed: int | None) -> SlotRequest:
    return SlotRequest(request.context, request.max_gen_toks, request.until, seed)


class Seeder:
    """Per generation request, the seed of its own sampling generator (None for a greedy one):
    a hash of the evaluation's seed, the request's tokens and settings, and how many identical
    requests came before it (lm-eval's repeats), so a sampled answer is the same in every layout.

    The count of identical requests carries over from one call to the next, so requests given
    in parts, in order, get the seeds the whole request type given at once would get.

    Args:
        seed: The evaluation's seed.
    """

    def __init__(self, seed: int) -> None:
        self._seed = seed
        #: Sampled requests seen so far: sha256 of their identity -> occurrences - 1.
        self._seen: dict[bytes, int] = {}

    def seeds(self, requests: Sequence[GenerateRequest]) -> list[int | None]:
        """The seeds of the next ``requests``, in order."""
        seeds: list[int | None] = []
        for request in requests:
            if not request.kwargs.get("do_sample"):
                seeds.append(None)
                continue
            identity = json.dumps(
                [list(request.context), request.settings()], sort_keys=True, default=str
            )
            name = hashlib.sha256(identity.encode()).digest()  # held instead of the identity
            occurrence = self._seen[name] = self._seen.get(name, -1) + 1
            digest = hashlib.sha256(json.dumps([self._seed, identity, occurrence]).encode())
            seeds.append(int.from_bytes(digest.digest()[:8], "little") >> 1)
        return seeds


def request_seeds(requests: Sequence[GenerateRequest], seed: int) -> list[int | None]:
    """Per request, the seed of its own sampling generator (:class:`Seeder`, all at once)."""
    return Seeder(seed).seeds(requests)
