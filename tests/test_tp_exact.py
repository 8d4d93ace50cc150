"""Which tensor-parallel plans rayeval can run without splitting a sum
(actors/parallel/tp_exact.py).

Row-parallel layers are rewritten to split by output features; plans with styles that add
partial sums rayeval cannot rewrite make TP an obstacle, so that ``auto`` takes FSDP and ``tp``
is refused naming them. The numerics (bit-identical to one rank in bf16, fp16 and float32) are
checked end to end in tests/test_dtype_layouts.py and tests/test_tensor_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel import tp_exact
from rayeval.actors.parallel.strategies import model_obstacles, settle

pytestmark = pytest.mark.unit


def test_row_parallel_layers_are_rewritten_and_column_splits_kept() -> None:
    plan = {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "model.layers.*.block.o_proj": "rowwise_split_input",
    }
    overrides, inexact = tp_exact.exact_plan(plan)
    assert inexact == []
    assert overrides == {
        "lm_head": tp_exact.GATHERED,
        "model.layers.*.self_attn.q_proj": tp_exact.LOCAL,
        "model.layers.*.self_attn.o_proj": tp_exact.GATHER_INPUT,
        "model.layers.*.mlp.down_proj": tp_exact.GATHER_INPUT,
        "model.layers.*.block.o_proj": tp_exact.GATHERED,
    }


def test_a_plan_that_adds_partial_sums_rules_tp_out() -> None:
    import transformers

    config = transformers.Llama4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=100,
    )
    _, inexact = tp_exact.exact_plan(config.base_model_tp_plan)
    assert "packed_rowwise" in inexact
    obstacles = model_obstacles(config, 2)
    (reason,) = obstacles[ShardStrategy.TP]
    assert "adds partial sums over the ranks" in reason and "packed_rowwise" in reason
    assert settle("auto", 2, obstacles, []) is ShardStrategy.FSDP
    with pytest.raises(Exception, match="packed_rowwise"):
        settle("tp", 2, obstacles, [])


def test_llama_plan_is_exact_after_the_rewrite() -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=100,
    )
    assert model_obstacles(config, 2)[ShardStrategy.TP] == []
    assert settle("auto", 2, model_obstacles(config, 2), []) is ShardStrategy.TP


def test_tp_is_refused_on_an_architecture_it_was_not_checked_on(monkeypatch: Any) -> None:
    """A plan that runs is not enough: HRM's ran and answered wrongly (docs/conformance.md).
    tp is for the architectures checked against lm-eval hf; auto picks FSDP for the others, and
    RAYEVAL_UNCHECKED_TP=1 (the conformance matrix) tries it anyway."""
    import transformers

    from rayeval.actors.parallel.tensor_parallel import UNCHECKED_ENV

    config = transformers.AutoConfig.for_model(
        "phi3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=1, vocab_size=100,
    )  # fmt: skip
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    obstacles = model_obstacles(config, 2)
    (reason,) = obstacles[ShardStrategy.TP]
    assert "not checked against lm-eval hf for the phi3 architecture" in reason, reason
    assert settle("auto", 2, obstacles, []) is ShardStrategy.FSDP
    with pytest.raises(Exception, match=r"docs/conformance\.md"):
        settle("tp", 2, obstacles, [])
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    assert model_obstacles(config, 2)[ShardStrategy.TP] == []
