"""Small random models of the architectures users bring, built in seconds for the tests.

Random weights (a wider spread than transformers' initialisation, so that logits are far from
uniform) give near ties everywhere: a sum rounded differently in bf16 changes a greedy token or a
routed expert at once, which makes these models canaries for results that move with the layout.
They use the bundled demo tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Architecture name -> config arguments (besides the tokenizer's ids).
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2: tied embeddings, grouped-query attention, biases on q/k/v; sums of 256 and 704.
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    # Qwen3-MoE: 8 experts, top-2 routing (a router's near tie sends a token elsewhere).
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    # GPT-NeoX: fused query-key-value rows, partial rotary, untied head (embed_out).
    "gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rotary_pct": 0.5,
        "tie_word_embeddings": False,
    },
    # GPT-2: Conv1D projections (weights stored in x out), learned positions, tied head.
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
        "tie_word_embeddings": True,
    },
}


def build_model(
    arch: str,
    out_dir: Path,
    tokenizer_dir: Path,
    extra_rows: int = 0,
    generation: dict[str, Any] | None = None,
) -> Path:
    """Save a random ``arch`` model (:data:`SHAPES`) and the demo tokenizer in ``out_dir``.

    Args:
        arch: A key of :data:`SHAPES`.
        out_dir: Where the model folder goes.
        tokenizer_dir: The tokenizer's folder (the demo model's).
        extra_rows: Embedding rows beyond the tokenizer's tokens (an odd count gives a
            vocabulary that two ranks do not divide).
        generation: Settings added to the model's ``generation_config.json``.
    """
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(SHAPES[arch])
    config = transformers.AutoConfig.for_model(
        shape.pop("model_type"),
        vocab_size=len(tokenizer) + extra_rows,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=512,
        **shape,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
    if generation:
        for key, value in generation.items():
            setattr(model.generation_config, key, value)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
