"""A generation workload whose greedy answers vary from a few tokens to ~100: model and task.

Continuous batching pays when the answers of one batch differ in length. This module builds,
deterministically from a seed (one torch thread; ~15 s on two idle cores, under a minute on
busy ones), a tiny Llama whose greedy answer has a length its question sets, and an lm-eval
``generate_until`` task over it:

* the corpus is documents of 2-5 question-answer pairs. Four in five count down in numbers,
  ``Q: <filler> count down from 23. A: 23 22 21 ... 1 0`` then ``\\n\\n``; one in five in letters,
  ``Q: <filler> say the letters back from e. A: e d c b a Q:`` (the next question starts on the
  same line: the stop string ``Q:`` is met across the tokens `` Q`` and ``:``). The 0-24 filler
  words vary the prompt length independently of the answer's, so that lm-eval's batches (sorted
  by prompt length) mix answer lengths as real tasks do;
* a byte-level BPE tokenizer (every `` 0``-`` 99`` and every letter one token) and a 2-block
  Llama (0.42M parameters, 128 wide) trained for 200 steps. The prompt ends with the answer's
  first item, so what follows is a bigram chain and greedy answers follow the rule: 359 of the
  360 (the other reaches ``max_gen_toks``);
* the task ``varied_countdown``: 360 questions, numbers drawn from a Beta(1.8, 2.2) over 0-99,
  ``until: ["\\n\\n", "Q:"]``, ``max_gen_toks: 96``, greedy. Counting down from n needs n + 2 new
  tokens (capped at 96), the letters 2-27: 15,049 tokens in all, 2 to 96 per answer.

The tests never see this model or task. Usage::

    from benchmarks.varied_workload import build_varied_model, write_varied_task
    model_dir = build_varied_model(Path("out/model"))
    include_path = write_varied_task(Path("out/tasks"))   # task VARIED_TASK
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VARIED_TASK = "varied_countdown"
UNTIL = ["\n\n", "Q:"]
MAX_GEN_TOKS = 96
REQUESTS = 360
MAX_NUMBER = 99
CONTEXT_LENGTH = 256  # the model's window: prompt (<= ~45 tokens) + 96 new tokens fit
VOCAB_SIZE = 512

TRAIN_DOCS = 1500
TRAIN_STEPS = 200
TRAIN_WINDOW = 128
TRAIN_BATCH = 8
LEARNING_RATE = 1e-2
WARMUP_STEPS = 20

# fmt: off
FILLER = [
    "the", "red", "fox", "ran", "past", "one", "small", "gray", "house", "near", "an", "old",
    "mill", "while", "two", "quiet", "birds", "sang", "over", "green", "fields", "and", "one",
    "tired", "dog", "slept", "under", "tall", "trees",
]
# fmt: on
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LETTER_SHARE = 0.2  # of the questions: the rest count down in numbers


def question(rng: random.Random, start: str, letters: bool) -> str:
    """One prompt: filler words, what to count down from, and the answer's first item."""
    filler = " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 24)))
    what = "say the letters back" if letters else "count down"
    return f"Q: {filler + ' ' if filler else ''}{what} from {start}. A: {start}"


def continuation(start: str, letters: bool) -> str:
    """What follows the prompt's first item: the rest of the countdown and its separator."""
    if letters:
        index = LETTERS.index(start)
        return "".join(f" {c}" for c in LETTERS[index - 1 :: -1] if index) + " Q:"
    return "".join(f" {n}" for n in range(int(start) - 1, -1, -1)) + "\n\n"


def _draw(rng: random.Random, uniform: bool) -> tuple[str, bool]:
    """A countdown start: a letter, or a number (uniform for training, skewed for the task)."""
    if rng.random() < LETTER_SHARE:
        return rng.choice(LETTERS), True
    if uniform:
        return str(rng.randint(0, MAX_NUMBER)), False
    return str(min(MAX_NUMBER, int(rng.betavariate(1.8, 2.2) * (MAX_NUMBER + 1)))), False


def corpus(seed: int, docs: int = TRAIN_DOCS) -> list[str]:
    """Training documents: 2-5 question-answer pairs each, numbers uniform over 0-99.

    A letters answer is followed by `` Q:`` on its line, so the next question starts there.
    """
    rng = random.Random(seed)
    texts = []
    for _ in range(docs):
        text = ""
        for _ in range(rng.randint(2, 5)):
            start, letters = _draw(rng, uniform=True)
            text += question(rng, start, letters) + continuation(start, letters)
        texts.append(text.replace(" Q:Q: ", " Q: "))
    return texts


def test_documents(seed: int, count: int = REQUESTS) -> list[dict[str, Any]]:
    """The task's documents: the question and the answer lm-eval keeps when the rule is met."""
    rng = random.Random(seed + 1)
    docs = []
    for _ in range(count):
        start, letters = _draw(rng, uniform=False)
        kept = continuation(start, letters)
        kept = kept.split("Q:")[0] if letters else kept.split("\n\n")[0]
        docs.append({"question": question(rng, start, letters), "answer": kept, "start": start})
    return docs


def write_varied_task(out_dir: Path, seed: int = 0, requests: int = REQUESTS) -> Path:
    """Write the task's JSONL and YAML into ``out_dir`` (an lm-eval ``include_path``).

    Args:
        out_dir: Directory to write (created if missing).
        seed: Seed of the questions (the model's seed need not match).
        requests: Number of questions (``generate_until`` requests).

    Returns:
        ``out_dir``; the task is :data:`VARIED_TASK`.
    """
    import yaml

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{VARIED_TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in test_documents(seed, requests)))
    config = {
        "task": VARIED_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    (out_dir / f"{VARIED_TASK}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir


def build_varied_model(out_dir: Path, seed: int = 0, steps: int = TRAIN_STEPS) -> Path:
    """Train the tokenizer and the 2-block Llama on :func:`corpus` and save both to ``out_dir``.

    Args:
        out_dir: Directory to write (created if missing); ``AutoModelForCausalLM`` and
            ``AutoTokenizer.from_pretrained(out_dir)`` load the result offline.
        seed: Seed of the corpus, the initial weights and the training batches; the build is
            deterministic for a seed and a torch version.
        steps: Optimiser steps.

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import LlamaForCausalLM

    from rayeval.service.demo.tiny_model import train_tokenizer

    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = corpus(seed)
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB_SIZE)
    tokenizer.model_max_length = CONTEXT_LENGTH
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [tokenizer.bos_token_id, *encoding.ids, tokenizer.eos_token_id]
    stream = torch.tensor(ids, dtype=torch.long)
    config = _config(tokenizer)
    threads = torch.get_num_threads()
    # One thread: fast enough for this size, the same bits whatever the machine's core count, and
    # no OpenMP busy-waiting when the cores are shared.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
            loss = _train(model, stream, steps=steps, seed=seed)
    finally:
        torch.set_num_threads(threads)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info(
        "varied-length model: %d parameters, %d corpus tokens, %d steps, loss %.3f, %.1f s",
        sum(p.numel() for p in model.parameters()),
        len(stream),
        steps,
        loss,
        time.perf_counter() - started,
    )
    return out_dir


def _config(tokenizer: Any) -> Any:
    """2 blocks, 128 wide, 4 heads (2 for keys and values), untied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _train(model: Any, stream: Any, *, steps: int, seed: int) -> float:
    """AdamW on random ``TRAIN_WINDOW`` windows of ``stream``, warm-up then cosine decay."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)

    def lr_factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    offsets = torch.arange(TRAIN_WINDOW)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - TRAIN_WINDOW, (TRAIN_BATCH,), generator=generator)
        batch = stream[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    model.eval()
    return float(loss.item())
