"""A tiny LoRA fine-tuning run for the adapter tests: a few optimiser steps of the ``peft``
package on the demo Llama, on the CPU, saved as trainers save adapters
(``adapter_config.json`` + ``adapter_model.safetensors``); and a delta-weights copy of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The modules the test adapter trains: attention and MLP projections of every block.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def train_lora(model_dir: Path, out: Path, corpus: list[str], steps: int = 8, seed: int = 0,
               rank: int = 8, lr: float = 5e-2, added_tokens: list[str] | None = None,
               save_embedding_layers: bool | str = "auto",
               targets: list[str] | None = None) -> Path:  # fmt: skip
    """Train a LoRA on ``corpus`` (causal LM loss) for ``steps`` steps; save it under ``out``.

    ``added_tokens``: tokens added to the tokenizer first, the base's embeddings resized for
    them (new rows drawn around the mean, as ``resize_token_embeddings`` draws them); the
    tokenizer is saved beside the adapter, and PEFT saves the resized embeddings and head with
    it (``save_embedding_layers="auto"``) unless told not to. ``targets``: the layers adapted
    (the Llama's attention and MLP projections unless given).
    """
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if added_tokens:
        tokenizer.add_tokens(added_tokens)
        base.resize_token_embeddings(len(tokenizer))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules=targets or TARGETS, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        batch = corpus[(step * 4) % len(corpus) :][:4] or corpus[:4]
        encoded = tokenizer(batch, return_tensors="pt", padding=True, truncation=True,
                            max_length=64)  # fmt: skip
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        loss = model(**encoded, labels=labels).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    model.save_pretrained(out, save_embedding_layers=save_embedding_layers)
    if added_tokens:
        tokenizer.save_pretrained(out)
    return out


def pad_vocabulary(model_dir: Path, out: Path, rows: int) -> Path:
    """The model at ``model_dir`` with tied embeddings padded to ``rows`` rows beyond its
    tokenizer (as Qwen pads its vocabulary), saved with that tokenizer under ``out``. The
    padded rows repeat the first ones, so that they hold a fair share of the softmax: lm-eval
    cuts them off again for a ``peft=`` adapter, which changes every log-probability."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = base.config
    config.vocab_size, config.tie_word_embeddings = rows, True
    padded = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = base.state_dict()
    weight = state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight")
    extra = rows - weight.shape[0]
    state["model.embed_tokens.weight"] = torch.cat([weight, weight[:extra]])
    padded.load_state_dict(state, strict=False)
    padded.tie_weights()
    padded.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def corpus_texts(data_dir: Path, limit: int = 64) -> list[str]:
    """Texts of the demo tasks' test documents (what the adapter learns from)."""
    texts: list[str] = []
    for path in sorted(data_dir.glob("*_test.jsonl")):
        for line in path.read_text().splitlines():
            doc: dict[str, Any] = json.loads(line)
            texts.append(" ".join(str(v) for v in doc.values() if isinstance(v, str)))
    return texts[:limit]
