"""Shared-prefix scoring: shared tokens fed once, results still lm-eval's own, in every layout.

Against lm-eval's ``hf`` backend, per sample (|delta logprob| <= 1e-4, same ``is_greedy``, same
metrics), on tasks shaped like hellaswag (multi-token endings after one context), 10-shot ARC and
5-shot MMLU (the same few-shot examples before every question): with the whole prompt in the
window, with left truncation cutting into the shared part (a small ``max_length``), with a
tokenizer that adds BOS plus a chat template, in 1x1, 1x2 (FSDP) and 2x1. Without Ray: packed rows
score like plain rows for Llama, GPT-2 and Qwen2 under sdpa and eager attention.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.batches import ModelSpec
from rayeval.actors.layout import DeviceKind, RankCoord
from rayeval.service.engine.plan.planner import TokenBudget, plan_score
from rayeval.service.parity import LOGPROB_TOL
from tests.helpers import assert_same_results, evaluate, hf_spread

TASKS = ["shaped_hellaswag", "shaped_arc", "shaped_mmlu"]
LIMIT = 5
WIDE = 512  # max_length: every prompt fits
# max_length: truncation cuts into every few-shot prompt and into some hellaswag-shaped ones,
# while other hellaswag-shaped documents still fit and share (4 packed rows, 12 plain).
NARROW = 64


# ----------------------------------------------------------------------------- planner only
@pytest.mark.unit
def test_pack_prefixes_shares_contexts_and_leaves_truncated_inputs_apart() -> None:
    context = [5, 6, 7, 8, 9, 10]
    requests = [(context, [11, 12, 13]), (context, [14, 15]), (context, [11, 12, 16])]
    requests += [([5, 6, 7, 8, 20], [21])]  # another question behind the same "few-shot" prefix
    plan = plan_score(requests, max_length=64, budget=TokenBudget(1000), share_prefixes=True)
    (batch,) = plan.micro_batches
    (row,) = batch.rows
    assert row.parents is not None and row.positions is not None
    # 4 shared + 2 of the first context + the branches: 11 12 | 15 | 20 (continuations minus last)
    assert len(row.tokens) == 4 + 2 + 2 + 1 + 1
    for (ctx, cont), loc in zip(requests, plan.locations, strict=True):
        assert row.targets[loc.target] == tuple(cont)
        path = row.scored_positions()[loc.target]
        # Walking up from the last scored token gives back exactly lm-eval's input.
        node, walked = path[-1], []
        while node >= 0:
            walked.append(row.tokens[node])
            node = row.parents[node]
        assert tuple(reversed(walked)) == tuple(ctx + cont)[:-1]
    # A window that cuts into the shared context: plain rows, lm-eval's inputs (two of them are
    # token-identical after the cut: one row, two targets, as without sharing).
    plan = plan_score(requests[:3], max_length=5, budget=TokenBudget(1000), share_prefixes=True)
    rows = [row for mb in plan.micro_batches for row in mb.rows]
    assert sorted(row.tokens for row in rows) == [(7, 8, 9, 10, 14), (8, 9, 10, 11, 12)]
    assert all(row.parents is None for row in rows)


@pytest.mark.unit
def test_packed_micro_batches_are_cut_before_padding_dominates() -> None:
    # Two questions whose four choices part after one token pack into rows of 4 + 1 + 4 = 9
    # tokens; one with one-token choices is a 4-token row: not padded to 9 beside them.
    requests = [([n] * 4, [n + 1, 40 + c, n + 2]) for n in (10, 20) for c in range(4)]
    requests += [([30] * 4, [c]) for c in range(4)]
    plan = plan_score(requests, 64, TokenBudget(max_tokens=1000), share_prefixes=True)
    assert [[len(r.tokens) for r in mb.rows] for mb in plan.micro_batches] == [[9, 9], [4]]


@pytest.mark.unit
def test_rows_travel_as_32_bit_buffers_and_give_the_same_model_inputs() -> None:
    import pickle
    from array import array

    import torch

    from rayeval.actors.batches import ScoreMicroBatch, ScoreRow
    from rayeval.actors.compute.packing import packed_inputs, padded_ids

    rng = random.Random(1)
    prefix = [rng.randrange(5, 60_000) for _ in range(12)]
    requests = []
    for _ in range(5):  # questions behind one prefix: packed rows; truncated ones: plain rows
        context = prefix + [rng.randrange(5, 60_000) for _ in range(rng.randrange(1, 30))]
        requests += [(context, [rng.randrange(5, 60_000) for _ in range(k)]) for k in (1, 2, 3)]
    kinds = set()
    for window, share in ((64, True), (20, True), (64, False)):
        plan = plan_score(requests, window, TokenBudget(max_tokens=300), share_prefixes=share)
        kinds |= {row.parents is None for mb in plan.micro_batches for row in mb.rows}
        for batch in plan.micro_batches:
            received = pickle.loads(pickle.dumps(batch, protocol=5))
            for own, got in zip(batch.rows, received.rows, strict=True):
                assert isinstance(got.tokens, array) and tuple(got.tokens) == own.tokens
                assert (got.targets, got.positions) == (own.targets, own.positions)
                assert got.scored_positions() == own.scored_positions()
                if own.parents is not None:
                    assert got.parents is not None and tuple(got.parents) == own.parents
            assert torch.equal(padded_ids(received.rows, 3), padded_ids(batch.rows, 3))
            ours, theirs = packed_inputs(received.rows, 3, None), packed_inputs(batch.rows, 3, None)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert kinds == {True, False}  # plain rows and packed ones
    # An id beyond 32 bits (no tokenizer has one) travels as it is.
    wide = ScoreRow((1, 2**40), ((7,),))
    assert pickle.loads(pickle.dumps(ScoreMicroBatch((wide,)))).rows == (wide,)


@pytest.mark.service
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_packed_rows_score_like_plain_rows(arch: str, demo: Any, tmp_path: Path) -> None:
    import torch
    import transformers

    from rayeval.service.demo.tiny_model import make_config

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(arch, tokenizer))
    model_dir = tmp_path / arch
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    requests = []
    for _ in range(6):
        context = [rng.randrange(5, 700) for _ in range(rng.randrange(4, 40))]
        for _ in range(3):
            requests += [(context, [rng.randrange(5, 700) for _ in range(rng.randrange(1, 9))])]
    for attention in ("sdpa", "eager"):
        worker = _worker(model_dir, attention)
        answers = {}
        for share in (False, True):
            plan = plan_score(requests, 48, TokenBudget(max_tokens=200), share_prefixes=share)
            assert any(r.parents for mb in plan.micro_batches for r in mb.rows) == share
            results = [worker.score(mb)[0] for mb in plan.micro_batches]
            answers[share] = [results[c.micro_batch][c.row][c.target] for c in plan.locations]
        for plain, packed in zip(answers[False], answers[True], strict=True):
            assert abs(plain[0] - packed[0]) <= LOGPROB_TOL and plain[1] == packed[1]


def _worker(model_dir: Path, attention: str) -> Any:
    import transformers

    from rayeval.actors.worker import RankOptions, ShardWorker

    pad = transformers.AutoTokenizer.from_pretrained(model_dir).pad_token_id
    spec = ModelSpec(
        pretrained=str(model_dir),
        dtype="float32",
        pad_token_id=pad,
        extra_kwargs={"attn_implementation": attention},
    )
    worker = ShardWorker(
        spec, RankCoord(0, 0, 0), RankOptions(1, DeviceKind.CPU, collective_timeout_s=60)
    )
    worker.setup(("127.0.0.1", 0))  # one rank: no process group, the address is not used
    return worker


# ------------------------------------------------------------------- against lm-eval's hf
@pytest.fixture(scope="module")
def shaped(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lm_eval.tasks import TaskManager

    from rayeval.service.demo.shaped import write_shaped_tasks

    tasks_dir = write_shaped_tasks(tmp_path_factory.mktemp("shaped"), docs=LIMIT)
    return TaskManager(include_defaults=False, include_path=str(tasks_dir))


@pytest.fixture(scope="module")
def bos_chat_model(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with a tokenizer that prepends BOS and has a chat template."""
    import transformers
    from tokenizers.processors import TemplateProcessing

    model_dir = tmp_path_factory.mktemp("bos_chat") / "model"
    shutil.copytree(demo.model_dir, model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    bos = (tokenizer.bos_token, tokenizer.bos_token_id)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer.save_pretrained(model_dir)
    assert transformers.AutoTokenizer.from_pretrained(model_dir).encode("a cat")[0] == bos[1]
    return model_dir


def _hf(model_dir: Path, task_manager: Any, max_length: int, **kwargs: Any) -> tuple[Any, int]:
    """lm-eval's hf backend's results, and the tokens its model was fed (embedding hook)."""
    from lm_eval.api.registry import get_model

    lm = get_model("hf").create_from_arg_obj(
        {"pretrained": str(model_dir), "dtype": "float32", "max_length": max_length},
        {"batch_size": 4, "device": "cpu"},
    )
    fed = [0]
    lm.model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, args: fed.__setitem__(0, fed[0] + args[0].numel())
    )
    results = evaluate(lm, task_manager, TASKS, limit=LIMIT, bootstrap_iters=0, **kwargs)
    return results, fed[0]


def _ours(
    model_dir: Path,
    task_manager: Any,
    layout: tuple[int, int],
    max_length: int,
    shard_strategy: str = "fsdp",
    **kwargs: Any,
) -> tuple[Any, dict[str, int]]:
    """rayeval's results, and the tokens its ranks' models were fed, summed over ranks."""
    from rayeval.service.engine.lm import RayEvalLM

    with RayEvalLM(
        pretrained=str(model_dir),
        num_replicas=layout[0],
        shard_size=layout[1],
        shard_strategy=shard_strategy,
        dtype="float32",
        max_length=max_length,
        batch_size="auto",
        max_batch_tokens=1024,
    ) as lm:
        assert lm.engine.share_prefixes
        results = evaluate(lm, task_manager, TASKS, limit=LIMIT, bootstrap_iters=0, **kwargs)
        return results, lm.engine.input_token_counts()


@pytest.fixture(scope="module")
def wide_reference(demo: Any, shaped: Any) -> tuple[Any, int]:
    return _hf(demo.model_dir, shaped, WIDE)


@pytest.fixture(scope="module")
def wide_1x1(demo: Any, shaped: Any, ray_session: None) -> tuple[Any, dict[str, int]]:
    return _ours(demo.model_dir, shaped, (1, 1), WIDE)


@pytest.mark.e2e
def test_matches_hf_and_feeds_fewer_tokens(wide_reference: Any, wide_1x1: Any) -> None:
    (reference, hf_fed), (ours, counts) = wide_reference, wide_1x1
    assert_same_results(reference, ours)
    # Shared contexts went through the model once: well under lm-eval's tokens, padding included.
    assert counts.fed <= 0.6 * hf_fed, (counts, hf_fed)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("layout", "strategy"),
    [((1, 2), "fsdp"), ((2, 1), "fsdp"), ((1, 2), "tp")],
    ids=["1x2-fsdp", "2x1", "1x2-tp"],
)
def test_sharded_and_replicated_layouts(
    layout: tuple[int, int], strategy: str, demo: Any, shaped: Any, wide_1x1: Any, ray_session: None
) -> None:
    """FSDP and replicas are bit-identical to 1x1 (the same micro-batches, the same kernels);
    TP within the fidelity bound (its ranks multiply slices of each layer: other kernels)."""
    ours, _ = _ours(demo.model_dir, shaped, layout, WIDE, shard_strategy=strategy)
    assert_same_results(wide_1x1[0], ours, exact=strategy != "tp")


@pytest.mark.e2e
def test_left_truncation_into_the_shared_context(demo: Any, shaped: Any, ray_session: None) -> None:
    reference, _ = _hf(demo.model_dir, shaped, NARROW)
    ours, _ = _ours(demo.model_dir, shaped, (1, 1), NARROW)
    assert_same_results(reference, ours)


@pytest.mark.e2e
def test_bos_tokenizer_and_chat_template(
    bos_chat_model: Path, shaped: Any, ray_session: None
) -> None:
    options = {"apply_chat_template": True, "fewshot_as_multiturn": True}
    reference, _ = _hf(bos_chat_model, shaped, WIDE, **options)
    ours, _ = _ours(bos_chat_model, shaped, (1, 1), WIDE, **options)
    assert_same_results(reference, ours)


@pytest.mark.service
@pytest.mark.parametrize("value", ["false", "true"])
def test_share_prefixes_flag_reaches_the_config(value: str, demo: Any) -> None:
    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args as _config_from_args

    model = f"pretrained={demo.model_dir}"
    args = build_parser().parse_args(
        ["run", "--model", "hf", "--model_args", model, "--tasks", "x", "--share_prefixes", value]
    )
    config, _ = _config_from_args(args)
    assert config.share_prefixes is (value == "true")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--share_prefixes", "maybe"])


@pytest.mark.e2e
@pytest.mark.parity  # bf16: `make test-avx2` runs it again with the kernels capped
def test_bf16_scores_are_not_packed(demo: Any, ray_session: None) -> None:
    """In bf16 a packed row would change lm-eval hf's bits: attention rounds by the width it runs
    over (on an AVX-512 CPU, bf16 sdpa's first 12 queries get other bits at 16+ keys than at
    12-15), and the three demo_mc questions packed into one 34-token row moved doc 0's four
    log-probs and one of doc 1's by a bf16 step (-0.5586 -> -0.5312, -0.3633 -> -0.3457), while
    lm-eval hf at batch sizes 1, 4 and 16 agreed bit for bit. Half precision scores plain rows."""
    from lm_eval.tasks import TaskManager

    from rayeval.service.engine.lm import RayEvalLM

    task_manager = TaskManager(include_defaults=False, include_path=str(demo.tasks_dir))
    tasks = ["demo_mc", "demo_gen_short"]
    run = {"limit": 3, "gen_kwargs": "max_gen_toks=5", "bootstrap_iters": 0}
    with RayEvalLM(pretrained=str(demo.model_dir), dtype="bfloat16") as lm:
        assert not lm.engine.share_prefixes  # asked for (the default), not applied in bf16
        ours = evaluate(lm, task_manager, tasks, **run)
    spread = hf_spread(demo.model_dir, task_manager, tasks, "bfloat16", **run)
    spread.assert_holds(ours, "rayeval 1x1, bf16, share_prefixes on")
