"""A Llama of a chosen shape with random weights, for the benchmarks that measure memory and speed.

``add_model_arguments`` adds its shape flags to a parser, ``build_model`` saves it (fp32, the
demo tokenizer), ``model_figures`` gives its size and that of its largest FSDP unit. Used by
bench_memory.py and bench_generate.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape of the Llama :func:`build_model` builds (default: 239M parameters, 912 MiB)."""
    parser.add_argument("--hidden", type=int, default=768, help="Llama hidden size (768)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP size (2048)")
    parser.add_argument("--layers", type=int, default=32, help="decoder blocks (32)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (12)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (8192)")


def build_model(out_dir: Path, args: argparse.Namespace, tokenizer_dir: Path) -> None:
    """Save a random-weight fp32 Llama and the demo tokenizer in ``out_dir``."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def model_figures(model_dir: Path) -> dict[str, int]:
    """Bytes of the whole model and of its largest FSDP unit (as ``actors`` shards it)."""
    import torch
    import transformers

    from rayeval.actors.parallel.fsdp_units import decoder_blocks, embedding_units

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def size(modules: list[Any]) -> int:
        params = {id(p): p for m in modules for p in m.parameters()}
        return sum(p.numel() * p.element_size() for p in params.values())

    units = [[block] for block in decoder_blocks(model)] + embedding_units(model)
    return {"model": size([model]), "largest_unit": max(size(unit) for unit in units)}
