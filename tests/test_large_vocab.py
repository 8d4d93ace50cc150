"""Scoring at a real vocabulary size holds a bounded slice of the logits, with lm-eval hf's answers.

A Qwen2-style model with Qwen2.5's vocabulary of 151,936 tokens (random weights; the demo
tokenizer's tokens are the first 768) scores multiple choice, loglikelihood and rolling
loglikelihood with a logits budget of 1 MiB: its scored positions run through the output head 16
at a time (the fewest a chunk has), so a rolling window of a few hundred positions is scored in
dozens of chunks. The chunks must not change a row's arithmetic: on one rank, per target, the
results are the bits of a budget that holds every position at once, in float32 and bf16; through
the engine they are lm-eval hf's (float32: within the fidelity tolerance; bf16: within lm-eval
hf's own spread between batch sizes). At 1x2 under FSDP the two ranks score different
micro-batches with different numbers of chunks (they agree on the most, so their collectives stay
in step), and under tensor parallelism they gather each chunk's logits together.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.batches import ModelSpec, ScoreMicroBatch, ScoreRow
from rayeval.actors.layout import DeviceKind, RankCoord
from tests.helpers import assert_same_results, evaluate, hf_reference, hf_spread
from tests.models import build_model

pytestmark = [pytest.mark.e2e]

#: Qwen2.5's vocabulary (the embedding's rows beyond the demo tokenizer's are never fed).
VOCAB = 151_936
RUN = {"num_fewshot": 1, "limit": 3, "bootstrap_iters": 0}
TASKS = ["demo_mc", "demo_cloze", "demo_rolling"]
#: A budget that holds every scored position of a micro-batch at once (no chunks).
WHOLE_MIB = 2**20
#: A budget of 16 positions at this vocabulary (the fewest a chunk has), and one of 80 (under
#: FSDP every chunk gathers the head again: fewer chunks, still a different count per rank).
SMALL_MIB, FSDP_MIB = 1, 100
#: Layout name -> (replicas, shard size, strategy).
LAYOUTS = {"1x1": (1, 1, "auto"), "1x2-fsdp": (1, 2, "fsdp"), "1x2-tp": (1, 2, "tp")}


@pytest.fixture(scope="module")
def big_vocab(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    out = tmp_path_factory.mktemp("big_vocab") / "qwen2"
    return build_model("qwen2", out, demo.model_dir, extra_rows=VOCAB - len(tokenizer))


def _rows(vocab: int) -> tuple[ScoreRow, ...]:
    """Rolling-like rows (long targets) and a multiple-choice row (one-token targets at one
    position): 1,000 scored positions or so."""
    draw = random.Random(0)
    rows = []
    for length in (300, 41, 17, 250, 120):
        tokens = tuple(draw.randrange(vocab) for _ in range(length))
        rows.append(ScoreRow(tokens[:-1], (tokens[-draw.randint(length // 2, length - 1) :],)))
    context = tuple(draw.randrange(vocab) for _ in range(30))
    rows.append(ScoreRow(context, tuple((draw.randrange(vocab),) for _ in range(4))))
    return tuple(rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_chunks_give_the_bits_of_one_pass(dtype: str, big_vocab: Path) -> None:
    import transformers

    from rayeval.actors.worker import RankOptions, ShardWorker

    tokenizer = transformers.AutoTokenizer.from_pretrained(big_vocab)
    spec = ModelSpec(pretrained=str(big_vocab), dtype=dtype, pad_token_id=tokenizer.pad_token_id)
    batch = ScoreMicroBatch(_rows(len(tokenizer)))
    scored = sum(len(row.targets[0]) for row in batch.rows)  # the choices share a position
    answers, passes = {}, {}
    for budget in (WHOLE_MIB, SMALL_MIB):
        worker = ShardWorker(
            spec, RankCoord(0, 0, 0), RankOptions(1, DeviceKind.CPU, logits_budget_mib=budget)
        )
        worker.setup(("127.0.0.1", 0))  # one rank: no process group
        calls: list[int] = []
        head = worker._rank.model.get_output_embeddings()
        head.register_forward_hook(lambda _m, _a, out, calls=calls: calls.append(out.shape[-2]))
        answers[budget] = worker.score(batch)[0]
        passes[budget] = calls
    assert len(passes[WHOLE_MIB]) == 1 and passes[WHOLE_MIB][0] >= scored
    assert len(passes[SMALL_MIB]) == -(-passes[WHOLE_MIB][0] // 16)
    assert max(passes[SMALL_MIB]) == 16  # each pass: 16 rows (the last padded to 12 at least)
    assert answers[SMALL_MIB] == answers[WHOLE_MIB]


@pytest.fixture(scope="module")
def reference(big_vocab: Path, task_manager: Any) -> dict[str, Any]:
    """lm-eval hf's float32 results."""
    return hf_reference(big_vocab, task_manager, TASKS, **RUN)


@pytest.fixture(scope="module")
def runs(big_vocab: Path, task_manager: Any, ray_session: None) -> Any:
    """Each (dtype, layout, budget)'s results, and the largest chunk count a rank ran."""
    from rayeval.service.engine.lm import RayEvalLM

    cache: dict[tuple[str, str, int], dict[str, Any]] = {}

    def run(dtype: str, layout: str, budget_mib: int) -> dict[str, Any]:
        key = (dtype, layout, budget_mib)
        if key not in cache:
            replicas, shard_size, strategy = LAYOUTS[layout]
            with RayEvalLM(
                pretrained=str(big_vocab),
                num_replicas=replicas,
                shard_size=shard_size,
                shard_strategy=strategy,
                dtype=dtype,
                max_batch_tokens=512,  # several micro-batches: FSDP's ranks score different ones
                logits_budget_mib=budget_mib,
            ) as lm:
                cache[key] = evaluate(lm, task_manager, TASKS, **RUN)
        return cache[key]

    return run


def test_chunked_scoring_matches_lm_eval_hf_in_float32(runs: Any, reference: Any) -> None:
    assert_same_results(reference, runs("float32", "1x1", SMALL_MIB))


@pytest.mark.parity
def test_chunked_scoring_is_within_lm_eval_hf_s_spread_in_bf16(
    runs: Any, big_vocab: Path, task_manager: Any
) -> None:
    chunked = runs("bfloat16", "1x1", SMALL_MIB)
    spread = hf_spread(big_vocab, task_manager, TASKS, "bfloat16", **RUN)
    spread.assert_holds(chunked, "rayeval 1x1, 16-position head chunks")


@pytest.mark.parametrize("layout", ["1x2-fsdp", "1x2-tp"])
def test_chunked_scoring_on_two_ranks_matches_lm_eval_hf(
    layout: str, runs: Any, big_vocab: Path, task_manager: Any
) -> None:
    assert_same_results(
        hf_reference(big_vocab, task_manager, TASKS, **RUN), runs("float32", layout, 1)
    )
