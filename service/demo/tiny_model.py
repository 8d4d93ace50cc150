"""Build the bundled tiny demo model: a byte-level BPE tokenizer and a small causal LM.

Everything is built locally from the bundled demo corpus (``data/corpus.jsonl``), with no
network access, in well under a minute on two CPU cores:

1. a byte-level BPE tokenizer (``tokenizers`` library) wrapped in a transformers fast
   tokenizer, so ``AutoTokenizer.from_pretrained(out_dir)`` works offline;
2. a small randomly initialised causal LM (Llama by default; GPT-2 and Qwen2 are available
   as architecture families with tied input/output embeddings);
3. a short deterministic training run on the corpus, so the model scores clearly above
   chance on the demo tasks and its greedy generations depend on the prompt.

The corpus states the very facts the demo tasks ask about, so the scores measure
memorisation, not generalisation: the model exists to exercise evaluation plumbing
(batching, rolling windows, generation, sharding), not to be a good language model.
Its context window is deliberately small (128 positions) so that the rolling-loglikelihood
task has documents that need several windows.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from rayeval.service.demo.make_data import DATA_DIR

logger = logging.getLogger(__name__)

CORPUS_PATH = DATA_DIR / "corpus.jsonl"

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]
VOCAB_SIZE = 768
CONTEXT_LENGTH = 128
ARCHITECTURES = ("llama", "gpt2", "qwen2")

DEFAULT_TRAIN_STEPS = 300
BATCH_SIZE = 16
LEARNING_RATE = 1e-2
WARMUP_STEPS = 20
# One intra-op thread: the model is too small to gain from more, and multi-threaded OpenMP
# slows down badly (busy-waiting) when the CPUs are shared, e.g. with Ray workers or tests.
TRAIN_THREADS = 1


def load_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """Return the ``text`` field of every record of the demo corpus JSONL file."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a transformers tokenizer.

    The tokenizer adds no special tokens when encoding (like GPT-2's), so
    ``encode(text, add_special_tokens=False) == encode(text)``, and decoding round-trips
    any text exactly (byte-level, no clean-up of tokenization spaces).
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=CONTEXT_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def make_config(arch: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Return the tiny model config for architecture family ``arch``.

    ``llama`` has untied input/output embeddings; ``gpt2`` and ``qwen2`` tie them.
    """
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        config: PretrainedConfig = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT_LENGTH,
            tie_word_embeddings=False,
            **ids,
        )
    elif arch == "gpt2":
        config = GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=CONTEXT_LENGTH,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **ids,
        )
    elif arch == "qwen2":
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT_LENGTH,
            tie_word_embeddings=True,
            **ids,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    config.dtype = torch.float32
    return config


def _token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenate ``<s> text </s>`` for every text into one 1-D tensor of token ids."""
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(tokenizer.bos_token_id)
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _train(model: torch.nn.Module, stream: torch.Tensor, *, steps: int, seed: int) -> float:
    """Train ``model`` on random ``CONTEXT_LENGTH`` windows of ``stream``; return final loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)

    def lr_factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    offsets = torch.arange(CONTEXT_LENGTH)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        starts = torch.randint(0, len(stream) - CONTEXT_LENGTH, (BATCH_SIZE,), generator=generator)
        batch = stream[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0 or step == steps - 1:
            logger.debug("step %d/%d loss %.3f", step + 1, steps, loss.item())
    model.eval()
    return float(loss.item())


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Save model and tokenizer, the generation config naming the tokenizer's special ids."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def build_tiny_model(
    out_dir: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    train_steps: int = DEFAULT_TRAIN_STEPS,
) -> Path:
    """Train the tiny demo tokenizer and model and save both to ``out_dir``.

    Args:
        out_dir: directory to write (created if missing); afterwards
            ``AutoTokenizer.from_pretrained(out_dir)`` and
            ``AutoModelForCausalLM.from_pretrained(out_dir)`` load the result offline.
        arch: architecture family, one of ``"llama"`` (untied embeddings), ``"gpt2"`` or
            ``"qwen2"`` (tied embeddings).
        seed: seed for weight initialisation and batch sampling; the build is deterministic
            for a given seed and torch version.
        train_steps: number of optimiser steps (0 leaves the model untrained).

    Returns:
        ``out_dir``.

    The process-wide torch RNG state and thread count are restored before returning.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    texts = load_corpus()
    tokenizer = train_tokenizer(texts)
    stream = _token_stream(tokenizer, texts)

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(make_config(arch, tokenizer))
            model.to(torch.float32)
            loss = _train(model, stream, steps=train_steps, seed=seed)
    finally:
        torch.set_num_threads(previous_threads)

    _save(model, tokenizer, out_dir)
    logger.info(
        "built tiny %s model (%d parameters, vocab %d, %d corpus tokens, %d steps, "
        "final loss %.3f) in %.1fs at %s",
        arch,
        sum(p.numel() for p in model.parameters()),
        len(tokenizer),
        len(stream),
        train_steps,
        loss,
        time.perf_counter() - started,
        out_dir,
    )
    return out_dir
