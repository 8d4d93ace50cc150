"""Work planning: token-budget cuts, shared-context rows, and every request located exactly once."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from rayeval.actors.errors import ConfigError
from rayeval.service.engine.plan.generation_planner import GenerateRequest, plan_generate
from rayeval.service.engine.plan.planner import TokenBudget, model_input, plan_score

pytestmark = pytest.mark.unit


def test_model_input_truncates_from_the_left_like_lm_eval() -> None:
    assert model_input([1, 2, 3], [4, 5], max_length=10) == (1, 2, 3, 4)
    assert model_input([1, 2, 3, 4, 5, 6], [7, 8], max_length=4) == (4, 5, 6, 7)
    with pytest.raises(ConfigError, match="exceeds the model's max_length 2"):
        model_input([1], [2, 3, 4], max_length=2)


def test_plan_score_locates_every_request_and_shares_identical_inputs() -> None:
    # Two one-token answers to the same context share one row; a duplicate request shares a target.
    requests = [([1, 2, 3], [4]), ([1, 2, 3], [5]), ([9, 9], [8, 7]), ([1, 2, 3], [4])]
    plan = plan_score(requests, max_length=32, budget=TokenBudget(max_tokens=1000))
    assert sum(len(mb.rows) for mb in plan.micro_batches) == 2
    first, second, _, duplicate = plan.locations
    assert (first.micro_batch, first.row) == (second.micro_batch, second.row)
    assert first.target != second.target and duplicate == first
    for (context, continuation), loc in zip(requests, plan.locations, strict=True):
        row = plan.micro_batches[loc.micro_batch].rows[loc.row]
        assert row.targets[loc.target] == tuple(continuation)
        assert row.tokens == tuple((context + continuation)[:-1])


def test_plan_score_cuts_by_padded_tokens_longest_first() -> None:
    requests = [([1] * n, [2]) for n in (3, 10, 5, 8, 2, 9)]
    plan = plan_score(requests, max_length=64, budget=TokenBudget(max_tokens=20))
    widths = [[len(row.tokens) for row in mb.rows] for mb in plan.micro_batches]
    assert widths == [[10, 9], [8, 5], [3, 2]]
    for mb in plan.micro_batches:
        assert len(mb.rows) * len(mb.rows[0].tokens) <= 20


def test_budget_row_cap_and_oversized_single_row() -> None:
    requests = [([1] * 50, [2])] + [([n] * 4, [2]) for n in (3, 4, 5)]
    plan = plan_score(requests, 64, TokenBudget(max_tokens=10, max_rows=2))
    # The 50-token row exceeds the budget and still runs, alone; the rest obey both limits.
    assert [len(mb.rows) for mb in plan.micro_batches] == [1, 2, 1]
    with pytest.raises(ConfigError, match="must be >= 1"):
        TokenBudget(max_tokens=0)


def test_plan_generate_groups_by_settings_and_counts_generation_room() -> None:
    greedy = {"do_sample": False}
    requests = [
        GenerateRequest((1,) * 6, max_gen_toks=10, until=("\n",), kwargs=greedy),
        GenerateRequest((1,) * 3, max_gen_toks=10, until=("\n",), kwargs=greedy),
        GenerateRequest((2,) * 4, max_gen_toks=2, until=(".",), kwargs=greedy),
        GenerateRequest((1,) * 5, max_gen_toks=10, until=("\n",), kwargs=greedy),
    ]
    plan = plan_generate(requests, TokenBudget(max_tokens=32))
    # (6 + 10) * 2 = 32 fits; the third request of that group needs a new micro-batch.
    assert [len(mb.contexts) for mb in plan.micro_batches] == [2, 1, 1]
    for request, (mb, position) in zip(requests, plan.locations, strict=True):
        batch = plan.micro_batches[mb]
        assert batch.contexts[position] == request.context
        assert (batch.max_gen_toks, batch.until) == (request.max_gen_toks, request.until)


def test_continuous_batching_groups_are_planned_without_the_layout() -> None:
    from rayeval.service.engine.plan.generation_planner import (
        SlotBudget,
        plan_generate_groups,
        request_seeds,
    )

    requests = [GenerateRequest((1,) * n, 4, ("\n",)) for n in (3, 9, 5, 9, 1)]
    seeds = request_seeds(requests, 1234)
    assert seeds == [None] * 5
    plan = plan_generate_groups(requests, SlotBudget(slots=1, kv_tokens=13), seeds)
    assert [len(g.requests) for g in plan.groups] == [4, 1]  # 1 slot x 4 requests per group
    assert [len(r.context) for r in plan.groups[0].requests] == [9, 9, 5, 3]  # longest first
    assert plan.locations == [(0, 3), (0, 0), (0, 2), (0, 1), (1, 0)]
    names = [f"doc {i}" for i in range(5)]
    with pytest.raises(ConfigError, match=r"doc 1 needs 13 KV-cache positions.*--x"):
        plan_generate_groups(requests, SlotBudget(1, 12, "--x"), seeds, names)
    sampled = [GenerateRequest((1, 2), 4, (), kwargs={"do_sample": True})] * 2
    first, second = request_seeds(sampled, 1234)
    assert first != second and request_seeds(sampled, 1234) == [first, second]


def test_contexts_as_32_bit_buffers_are_planned_and_seeded_as_tuples() -> None:
    # A tokeniser actor's contexts arrive as array('i'): the same plans (their order compares
    # big-endian bytes) and the same seeds as the driver's tuples of the same ids.
    import random
    from array import array

    from rayeval.service.engine.plan.generation_planner import (
        SlotBudget,
        plan_generate_groups,
        request_seeds,
    )

    rng = random.Random(3)
    prefix = [rng.randrange(0, 2**31) for _ in range(5)]
    tuples = []
    for i in range(200):  # equal lengths and long shared prefixes: the order's hard cases
        ids = prefix[: rng.randrange(6)] + [rng.choice((0, 255, 256, 70_000, 2**31 - 1))] * 2
        ids += [rng.randrange(0, 2**31) for _ in range(rng.randrange(3))]
        sampled = {"do_sample": True} if i % 2 else {}
        tuples.append(GenerateRequest(tuple(ids), 4, ("\n",), kwargs=sampled))
    arrays = [replace(r, context=array("i", r.context)) for r in tuples]
    seeds = request_seeds(tuples, 5)
    assert request_seeds(arrays, 5) == seeds and None in seeds and len(set(seeds)) > 50
    budget = SlotBudget(slots=2, kv_tokens=64)
    ours, theirs = (
        plan_generate_groups(tuples, budget, seeds),
        plan_generate_groups(arrays, budget, seeds),
    )
    assert ours.locations == theirs.locations
    for group, other in zip(ours.groups, theirs.groups, strict=True):
        assert [r.context for r in group.requests] == [tuple(r.context) for r in other.requests]
    plan = plan_generate(tuples, TokenBudget(max_tokens=40))
    assert plan.locations == plan_generate(arrays, TokenBudget(max_tokens=40)).locations


def test_the_kv_budget_is_the_plan_and_memory_only_bounds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Without a KV-cache setting, the slots alone bound a group (its `slots` rows, each as long as
    # its largest request: the rows' caches are left-padded to the longest): the plan depends on
    # the requests and settings only. A rank's memory
    # bounds it only where it holds less; a request that needs more is refused, naming why.
    from rayeval.actors.errors import field
    from rayeval.service.engine.plan.budgets import MEMORY_SETTING, memory_kv_tokens, slot_budget
    from rayeval.service.engine.plan.generation_planner import SlotBudget, plan_generate_groups
    from rayeval.service.vocabulary.config import EngineConfig
    from rayeval.service.vocabulary.doors import Door, render

    requests = [GenerateRequest((1,) * n, 4, ("\n",)) for n in (30, 90, 50, 900, 10)]
    seeds = [None] * len(requests)
    free = slot_budget(EngineConfig(model_args="pretrained=m", batch_size=2), None)
    assert (free.slots, free.kv_tokens, free.prefill_tokens) == (2, None, 8192)
    [group] = plan_generate_groups(requests, free, seeds).groups
    assert group.kv_tokens == 2 * 904 and group.prefill_tokens == 8192
    assert memory_kv_tokens([None, None]) is None
    held = memory_kv_tokens([5000, None, 900])
    assert held == 900
    [bounded] = plan_generate_groups(
        requests[:3] + requests[4:], SlotBudget(2, held, MEMORY_SETTING), seeds[:4]
    ).groups
    assert bounded.kv_tokens == 2 * 94  # memory holds more than this group needs
    with caplog.at_level(logging.WARNING):
        [tight] = plan_generate_groups(
            requests[:3], SlotBudget(2, 100, MEMORY_SETTING), seeds[:3]
        ).groups
    assert tight.kv_tokens == 100 and "which rows decode together can differ" in caplog.text
    with pytest.raises(ConfigError, match=r"needs 904 KV-cache positions.*more than the budget "):
        plan_generate_groups(requests, SlotBudget(2, held, MEMORY_SETTING), seeds)
    options = EngineConfig(
        model_args="pretrained=m", batch_size=2, kv_cache_tokens=100, max_batch_tokens=300
    )
    budget = slot_budget(options, None)
    assert budget == SlotBudget(2, 100, field("kv_cache_tokens"), 300)
    with pytest.raises(ConfigError) as refused:
        plan_generate_groups(requests, budget, seeds)
    # Each door words the setting to raise its own way.
    assert "raise --kv_cache_tokens" in str(refused.value)
    assert "raise kv_cache_tokens" in render(refused.value, Door.REST)


def test_a_group_admits_by_slots_kv_cache_and_prefill_wave() -> None:
    from rayeval.actors.batches import GenerateGroup, SlotRequest

    def group(widths: list[int], **bounds: int) -> GenerateGroup:
        return GenerateGroup(tuple(SlotRequest((1,) * w, 10) for w in widths), **bounds)

    every = list(range(6))
    assert group([5] * 6, slots=4, kv_tokens=1000).admit([], every) == [0, 1, 2, 3]
    assert group([5] * 6, slots=4, kv_tokens=45).admit([], every) == [0, 1, 2]
    # the rows' caches are left-padded to the longest: rows x the most any needs (50) is held
    assert group([40, 5, 5], slots=4, kv_tokens=100).admit([], [0, 1, 2]) == [0, 1]
    assert group([40, 5, 5], slots=4, kv_tokens=100).admit([0], [1, 2]) == [1]
    assert group([5, 5, 40], slots=4, kv_tokens=100).admit([0, 1], [2]) == []
    # a prefill wave feeds at most rows x the widest context positions
    wide = group([40, 30, 30, 30, 30, 30], slots=8, kv_tokens=10**6, prefill_tokens=100)
    assert wide.admit([], every) == [0, 1]
    assert wide.admit([0, 1], [2, 3, 4, 5]) == [2, 3, 4]
    alone = group([500, 5], slots=8, kv_tokens=10**6, prefill_tokens=100)
    assert alone.admit([], [0, 1]) == [0]  # wider than a wave: prefilled alone
    # slots refill in waves of an eighth of them, or once every pending request fits
    many = group([5] * 20, slots=16, kv_tokens=10**6)
    assert many.admit(list(range(15)), [15, 16, 17]) == []
    assert many.admit(list(range(14)), [14, 15, 16]) == [14, 15]
    assert many.admit(list(range(15)), [19]) == [19]


def test_a_rank_holds_the_kv_cache_its_free_memory_allows(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from rayeval.actors.process import host_memory_share
    from rayeval.actors.profiles import KV_MEMORY_SHARE, ModelShape

    config = SimpleNamespace(
        model_type="llama",
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        hidden_size=256,
    )
    shape = ModelShape(config)
    per_token = 2 * 4 * 4 * 32 * 2  # keys and values, layers, kv heads, head dim, bf16
    assert shape.kv_bytes_per_token(2) == per_token
    free = 10 * 2**30
    assert shape.kv_capacity_tokens(free, 2, 1) == int(free * KV_MEMORY_SHARE // per_token)
    # tensor parallelism over 2 ranks keeps half of every position on each
    assert shape.kv_capacity_tokens(free, 2, 2) == int(free * KV_MEMORY_SHARE // (per_token / 2))
    assert ModelShape(SimpleNamespace(model_type="x")).kv_capacity_tokens(free, 2, 1) is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n")
    assert host_memory_share(2, 8, str(meminfo)) == 16000000 * 1024 // 4
    assert host_memory_share(8, 4, str(meminfo)) == 16000000 * 1024


def test_a_rank_sets_the_logits_aside_before_its_kv_cache() -> None:
    from rayeval.actors.batches import RankOptions, head_chunk_rows
    from rayeval.actors.worker import logits_reserve

    # scoring holds one head chunk: 256 MiB at the default budget, 208 positions at 152k tokens
    assert head_chunk_rows(151_936, 256 * 2**20) == 208
    assert head_chunk_rows(151_936, 64 * 2**20) == 48
    assert head_chunk_rows(151_936, 2**20) == 16  # the fewest a chunk has
    assert head_chunk_rows(768, 64 * 2**20) == 10_912
    options = RankOptions(1)
    assert logits_reserve(options, 768) == 256 * 2**20  # a small vocabulary: the scoring budget
    # 128 generating rows of a 256k vocabulary: float32 logits, scores and a copy
    wide = RankOptions(1, generate_rows=128)
    assert logits_reserve(wide, 256_000) == 128 * 256_000 * 4 * 3
    assert logits_reserve(RankOptions(1, generate_rows=8), 256_000) == 256 * 2**20


def test_the_run_says_what_batch_size_auto_picked() -> None:
    from rayeval.actors.layout import DeviceKind
    from rayeval.service.engine.plan.budgets import picked_budgets
    from rayeval.service.vocabulary.config import EngineConfig

    config = EngineConfig(model_args="pretrained=m")
    assert picked_budgets(config, DeviceKind.CPU, 151_936) == (
        "batch_size auto: scoring micro-batches of 2,048 tokens and 64 rows at most, the output "
        "head over at most 208 scored positions at a time (256 MiB of logits at a vocabulary of "
        "151,936); generation in groups of 64 rows"
    )
    config = EngineConfig(model_args="pretrained=m", batch_size=8, logits_budget_mib=1)
    assert picked_budgets(config, DeviceKind.CUDA, 0).startswith(
        "batch_size 8: scoring micro-batches of any number of tokens and 8 rows at most, the "
        "output head over every scored position at once"
    )
