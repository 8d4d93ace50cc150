"""Tensor parallelism: a replica's ranks compute one batch together with transformers' TP plan.

Per sample against lm-eval's own hf backend (|delta logprob| <= 1e-4, identical is_greedy,
greedy generations and metrics) on the demo group (loglikelihood, loglikelihood_rolling,
generate_until), at 1x2 (the default strategy picks TP for the demo Llama; the ranks gather
their activations through shared memory) and 2x2 (``tp`` asked, with shared memory turned off:
gloo gathers them). Both are within the same bound of FSDP at 1x2, and not held to its bits: TP
splits no sum, but the matrix library multiplies a slice of a layer's columns with kernels of its
own choosing (bit-identical on one AVX-512 CPU and under the AVX2 caps; 1e-7 apart on another
AVX-512 CPU).
A vocabulary G does not divide (an embedding one row larger than the tokenizer, with a generation
config of a repetition penalty, an n-gram ban and two end ids) is split unevenly and gathered
whole: a Qwen2-style model (tied) in float32 and bf16, a Qwen3-MoE-style one (untied) in float32.
A model whose heads G does not divide falls back to FSDP under ``auto`` (still matching lm-eval),
and ``tp`` is refused before anything starts, naming the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    assert_same_results,
    evaluate,
    half_precision_parity,
    hf_reference,
    hf_spread,
)
from tests.models import build_model

pytestmark = pytest.mark.e2e

RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}


@pytest.fixture(scope="module")
def reference(demo: Any, task_manager: Any) -> dict[str, Any]:
    return hf_reference(demo.model_dir, task_manager, ["demo"], **RUN)


@pytest.fixture(scope="module")
def fsdp_1x2(demo: Any, task_manager: Any, ray_session: None) -> dict[str, Any]:
    from rayeval.service.engine.lm import RayEvalLM

    with RayEvalLM(
        pretrained=str(demo.model_dir),
        shard_size=2,
        shard_strategy="fsdp",
        dtype="float32",
        max_batch_tokens=256,
    ) as lm:
        return evaluate(lm, task_manager, ["demo"], **RUN)


@pytest.mark.parametrize(
    ("layout", "strategy", "reduced_by"),
    [((1, 2), "auto", "shared memory"), ((2, 2), "tp", "process group")],
    ids=["1x2-auto", "2x2-tp-gloo"],
)
def test_tp_matches_lm_eval_hf(
    layout: tuple[int, int],
    strategy: str,
    reduced_by: str,
    demo: Any,
    task_manager: Any,
    reference: dict[str, Any],
    fsdp_1x2: dict[str, Any],
    ray_session: None,
) -> None:
    import transformers

    from rayeval.actors.layout import ShardStrategy
    from rayeval.service.engine.lm import RayEvalLM

    with RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=layout[0],
        shard_size=layout[1],
        shard_strategy=strategy,
        shm_collectives=reduced_by == "shared memory",
        dtype="float32",
        max_batch_tokens=256,  # several micro-batches, so replicas share the work
    ) as lm:
        ours = evaluate(lm, task_manager, ["demo"], **RUN)
        reports = lm.engine.load_reports
        assert lm.engine.shard_strategy is ShardStrategy.TP
    assert_same_results(reference, ours)
    assert_same_results(fsdp_1x2, ours)
    assert {"demo_mc", "demo_rolling", "demo_gen_short", "demo_gen_long"} <= set(ours["samples"])
    # Every rank holds its slices of the sharded projections, not the whole model.
    total = transformers.AutoModelForCausalLM.from_pretrained(demo.model_dir).num_parameters()
    assert {report.strategy for report in reports} == {"tp"}
    assert {report.collectives for report in reports} == {reduced_by}
    assert max(report.local_parameters for report in reports) < total


#: An odd vocabulary's model: what its generation_config.json sets (each processor reads the
#: whole vocabulary's logits, so every rank must see all of them).
ODD_GENERATION = {"repetition_penalty": 1.05, "no_repeat_ngram_size": 3, "eos_token_id": [1, 15]}


@pytest.fixture(scope="module")
def odd_vocabulary(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Models with 769 rows, one more than the tokenizer (385 and 384 at G = 2), and a
    generation config: Qwen2-style (tied embeddings), Qwen3-MoE-style (untied, 8 experts) and
    GPT-NeoX-style (fused query-key-value, untied ``embed_out``); built on first use."""
    root = tmp_path_factory.mktemp("odd_vocabulary")
    built: dict[str, Path] = {}

    def model(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_model(arch, root / arch, demo.model_dir, extra_rows=1,
                                      generation=ODD_GENERATION)  # fmt: skip
        return built[arch]

    return model


ODD_CASES = [
    ("qwen2", "float32"),
    ("qwen2", "bfloat16"),
    ("qwen3_moe", "float32"),
    ("gpt_neox", "float32"),
]


@pytest.mark.parametrize(
    ("arch", "dtype"), half_precision_parity(ODD_CASES, ["-".join(c) for c in ODD_CASES])
)
def test_a_vocabulary_g_does_not_divide_is_gathered_whole(
    arch: str, dtype: str, odd_vocabulary: Any, task_manager: Any, ray_session: None
) -> None:
    """The default strategy at 1x2 (tp) on every request type: the head's uneven rows are
    gathered into the whole vocabulary's logits on both ranks, which apply the same generation
    processors and stop alike; per sample as lm-eval hf (bf16: within its own spread)."""
    from rayeval.actors.layout import ShardStrategy
    from rayeval.service.engine.lm import RayEvalLM

    model_dir = odd_vocabulary(arch)
    with RayEvalLM(
        pretrained=str(model_dir), shard_size=2, dtype=dtype, max_batch_tokens=256
    ) as lm:
        ours = evaluate(lm, task_manager, ["demo"], **RUN)
        assert lm.engine.shard_strategy is ShardStrategy.TP
    assert {"demo_mc", "demo_rolling", "demo_gen_short", "demo_gen_long"} <= set(ours["samples"])
    if dtype == "float32":
        assert_same_results(hf_reference(model_dir, task_manager, ["demo"], **RUN), ours)
    else:
        spread = hf_spread(model_dir, task_manager, ["demo"], dtype, **RUN)
        spread.assert_holds(ours, f"rayeval 1x2 tp, {arch} with a vocabulary of 769")


def _odd_heads_llama(out_dir: Path, demo_dir: Path) -> Path:
    """A small random Llama with 3 attention heads: G = 2 divides neither head count."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(demo_dir)
    config.hidden_size, config.intermediate_size = 48, 96
    config.num_attention_heads = config.num_key_value_heads = 3
    config.head_dim = 16
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out_dir)
    return out_dir


def test_heads_g_does_not_divide_fall_back_to_fsdp_or_are_refused(
    tmp_path: Path, demo: Any, task_manager: Any, ray_session: None
) -> None:
    import ray

    from rayeval.actors.errors import ConfigError
    from rayeval.actors.layout import ShardStrategy
    from rayeval.service.engine.lm import RayEvalLM

    model_dir = _odd_heads_llama(tmp_path / "odd", demo.model_dir)
    pgs_before = len(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match="num_attention_heads=3 is not divisible by shard_size 2"):
        RayEvalLM(pretrained=str(model_dir), shard_size=2, shard_strategy="tp")
    assert len(ray.util.placement_group_table()) == pgs_before, "tp refused after it started"

    run = {"limit": 3, "bootstrap_iters": 0}
    tasks = ["demo_cloze", "demo_gen_short"]
    reference = hf_reference(model_dir, task_manager, tasks, **run)
    with RayEvalLM(pretrained=str(model_dir), shard_size=2, dtype="float32") as lm:
        ours = evaluate(lm, task_manager, tasks, **run)
        assert lm.engine.shard_strategy is ShardStrategy.FSDP
        assert lm.get_model_info()["rayeval_layout"]["shard_strategy"] == "fsdp"
    assert_same_results(reference, ours)
