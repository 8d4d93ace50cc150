"""The conformance matrix: every architecture users bring, at every layout, against lm-eval hf.

The architectures are not written here: they are read from the installed transformers (every
config class with a tensor-parallel plan whose model type has a causal-LM class, plus GPT-2 and
GPT-NeoX). For each, a tiny random model is built from its config class with shapes drawn to
stress sharding (:func:`draw_shape`): an odd vocabulary, an embedding larger than the tokenizer,
tied or untied heads, key/value heads that G = 2 does not divide, a ``generation_config.json``
with a repetition penalty, an n-gram ban, several end ids and bad words, and a LoRA adapter on the
architecture's own attention and MLP layers.

Each cell (architecture x layout x dtype) runs all four request types of the demo tasks through
rayeval, continuous batching and shared prefixes on, beside lm-eval hf on the same model and
samples (:func:`run_architecture`). A cell is ``exact`` (float32: within the fidelity bound;
bf16: no further from lm-eval hf than lm-eval hf is from itself between batch sizes 1, 4, 16),
``refused`` before any rank is placed (its reason recorded), or a failure: ``crashed`` or
``differs``. An architecture the generator cannot build or lm-eval hf cannot run is recorded as
such (``not built``, ``hf fails``): those say nothing about rayeval.

``make conformance`` runs every architecture and writes ``docs/conformance.md``;
``tests/test_conformance.py`` runs a few cells drawn by a seed that changes per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: Model types added to those with a TP plan: GPT-2 (Conv1D layers, no plan: auto picks FSDP)
#: and GPT-NeoX (its fused query-key-value rows).
ALSO = ("gpt2", "gpt_neox")

#: (replicas, shard_size, shard_strategy) of each layout a cell runs.
LAYOUTS: dict[str, tuple[int, int, str]] = {
    "1x1": (1, 1, "auto"),
    "2x1": (2, 1, "auto"),
    "1x2": (1, 2, "auto"),
    "1x2 fsdp": (1, 2, "fsdp"),
    "1x2 tp": (1, 2, "tp"),
}
DTYPES = ("float32", "bfloat16")

#: Every request type (the demo group: multiple choice, cloze, rolling, two generation tasks).
TASKS = ["demo"]
RUN = {"num_fewshot": 1, "limit": 3, "bootstrap_iters": 0}


def architectures() -> list[str]:
    """Every model type the installed transformers gives a tensor-parallel plan and a causal-LM
    class, plus :data:`ALSO`; sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = set(ALSO)
    for model_type in CONFIG_MAPPING_NAMES:
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        if getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None):
            found.add(model_type)
    return sorted(found)


@dataclass(frozen=True)
class Shape:
    """What was drawn for one architecture (the seed redraws it)."""

    model_type: str
    seed: int
    heads: int
    kv_heads: int
    head_dim: int
    extra_rows: int
    tied: bool
    generation: dict[str, Any]
    lora: bool
    #: Why the heads drawn were not built (the architecture refused them), if they were not.
    note: str = ""

    def describe(self) -> str:
        tied = "tied" if self.tied else "untied"
        gen = ",".join(sorted(self.generation)) or "none"
        lora = ", LoRA" if self.lora else ""
        note = f" ({self.note})" if self.note else ""
        return (
            f"heads {self.heads}/{self.kv_heads} kv x {self.head_dim}{note}, vocabulary "
            f"{VOCAB}+{self.extra_rows}, {tied}, generation: {gen}{lora}"
        )


#: The demo tokenizer's size (checked when a model is built).
VOCAB = 768


def draw_shape(model_type: str, seed: int) -> Shape:
    """Hostile shapes for ``model_type``, drawn from ``seed`` and the model type (so one
    architecture's draw does not depend on which others run)."""
    rng = random.Random(f"{seed}:{model_type}")
    heads = rng.choice([4, 6])
    # A quarter of the draws: key/value heads that G = 2 does not divide (one, or three of six),
    # which tensor parallelism must refuse before placement; else grouped-query or full heads.
    uneven = [d for d in (1, 3) if heads % d == 0]
    even = [d for d in (2, 4, 6) if heads % d == 0]
    kv_heads = rng.choice(uneven if rng.random() < 0.25 else even)
    generation: dict[str, Any] = {}
    if rng.random() < 0.5:
        generation["repetition_penalty"] = rng.choice([1.05, 1.3])
    if rng.random() < 0.5:
        generation["no_repeat_ngram_size"] = rng.choice([2, 3])
    if rng.random() < 0.5:
        generation["eos_token_id"] = [1, rng.randrange(8, 40)]
    if rng.random() < 0.3:
        generation["bad_words_ids"] = [[rng.randrange(40, 200)], [rng.randrange(40, 200)]]
    return Shape(
        model_type=model_type,
        seed=seed,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        extra_rows=rng.choice([0, 1, 3, 9]),
        tied=rng.random() < 0.5,
        generation=generation,
        lora=rng.random() < 0.5,
    )


#: A drawn model larger than this is the generator's mistake (a size field it does not shrink).
MAX_PARAMETERS = 8_000_000


def config_overrides(shape: Shape, defaults: dict[str, Any]) -> dict[str, Any]:
    """Config arguments that make ``shape``'s model tiny, for the keys its config class has
    (``defaults``: the class's default ``to_dict()`` and attribute map)."""
    hidden = shape.heads * shape.head_dim
    wanted: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 4,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": 512,
        "tie_word_embeddings": shape.tied,
        "vocab_size_per_layer_input": VOCAB + shape.extra_rows,
        "hidden_size_per_layer_input": 8,
        "intermediate_size_mlp": 2 * hidden,
        # mixtures of experts
        "num_experts": 4,
        "num_local_experts": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden,
        "shared_expert_intermediate_size": hidden,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        # multi-head latent attention
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "qk_head_dim": 16,
        "v_head_dim": shape.head_dim,
        # state-space and linear-attention layers
        "mamba_n_heads": 4,
        "mamba_d_head": 2 * hidden // 4,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_expand": 2,
        "full_attention_interval": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "mamba_d_ssm": 2 * hidden,
        "attn_layer_indices": [1, 3],
        "layer_group_size": 2,
        "num_kv_shared_layers": 0,
        # other spellings of the same sizes
        "num_experts_per_token": 2,
        "num_expert_group": 1,
        "unpadded_vocab_size": VOCAB + shape.extra_rows,
        "swa_num_attention_heads": shape.heads,
        "swa_num_key_value_heads": shape.kv_heads,
        "swa_head_dim": shape.head_dim,
        # sparse-attention indexers
        "index_num_heads": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_layers": [1],
        # GPT-2 and GPT-NeoX spellings
        "n_embd": hidden,
        "n_layer": 2,
        "n_head": shape.heads,
        "n_positions": 512,
        "n_inner": 2 * hidden,
        "rotary_dim": shape.head_dim // 2,
    }
    if "qk_rope_head_dim" in defaults:  # latent attention: RoPE runs on the rope part alone
        wanted["head_dim"] = wanted["qk_rope_head_dim"]
    wanted |= _per_layer_lists(defaults, wanted["num_hidden_layers"])
    return {key: value for key, value in wanted.items() if key in defaults}


def _per_layer_lists(defaults: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config's lists of one entry per layer (layer types, MLP types, limits), cut to
    ``layers``: kinds (strings) cycled so that each kind the default has still occurs, in the
    order the default has them; numbers cut to the first ``layers``."""
    count = defaults.get("num_hidden_layers")
    cut = {}
    for key, value in defaults.items():
        if not (isinstance(value, list) and count and len(value) == count):
            continue
        if all(isinstance(item, str) for item in value):
            kinds = list(dict.fromkeys(value))
            cut[key] = [kinds[i % len(kinds)] for i in range(layers)]
        else:
            cut[key] = value[:layers]
    return cut


def build_drawn(model_type: str, seed: int, out_dir: Path, tokenizer_dir: Path) -> Shape:
    """Build ``model_type``'s drawn model in ``out_dir``; where the architecture refuses the
    heads drawn (DiffLlama wants an even number of key/value heads), the same draw with 4
    heads and 2 key/value heads, the refusal noted in the shape.

    Raises:
        Exception: the drawn model cannot be built (the first error).
    """
    shape = draw_shape(model_type, seed)
    try:
        build(shape, out_dir, tokenizer_dir)
        return shape
    except Exception as exc:
        if (shape.heads, shape.kv_heads) == (4, 2):
            raise
        first = exc
    note = f"drawn {shape.heads}/{shape.kv_heads}: {_last_line(first)[:80]}"
    tame = replace(shape, heads=4, kv_heads=2, note=note)
    try:
        build(tame, out_dir, tokenizer_dir)
    except Exception:
        raise first from None
    return tame


def build(shape: Shape, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Save ``shape``'s random model, the demo tokenizer and its generation config in
    ``out_dir`` (and a LoRA adapter in ``out_dir/lora`` when drawn)."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == VOCAB, len(tokenizer)
    config_class = CONFIG_MAPPING[shape.model_type]
    defaults = config_class().to_dict()
    defaults.update(dict.fromkeys(getattr(config_class, "attribute_map", {})))
    ids = {
        "vocab_size": VOCAB + shape.extra_rows,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    text_class = getattr(config_class, "sub_configs", {}).get("text_config")
    if text_class is not None:  # a composite config (Llama 4): the text model is shrunk
        text_defaults = text_class().to_dict()
        text_defaults.update(dict.fromkeys(getattr(text_class, "attribute_map", {})))
        text = ids | config_overrides(shape, text_defaults)
        config = config_class(text_config=text, **config_overrides(shape, defaults))
    else:
        config = config_class(**ids, **config_overrides(shape, defaults))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    sizes = sorted((p.numel(), n) for n, p in meta.named_parameters())
    total = sum(size for size, _ in sizes)
    if total > MAX_PARAMETERS:
        raise ValueError(
            f"{total / 1e6:.1f}M parameters drawn (largest: {sizes[-3:]}): shrink its config"
        )
    torch.manual_seed(shape.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
    for key, value in shape.generation.items():
        setattr(model.generation_config, key, value)
    model.eval()
    with torch.no_grad():  # a forward that fails here fails in lm-eval hf too
        model(torch.tensor([[1, 5, 9, 13]]))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


#: Sentences the drawn LoRA adapters are trained on (a few steps: weights far from zero).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A model is evaluated on every request type.",
    "Two ranks hold half of the vocabulary each.",
    "Seven plus five is twelve, and twelve is even.",
]


def train_adapter(shape: Shape, model_dir: Path) -> Path:
    """A LoRA adapter trained for a few steps on ``model_dir``, on the layers peft targets for
    the architecture (its own default), or on every linear layer where peft names none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    from tests.lora_run import train_lora

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(shape.model_type)
    return train_lora(model_dir, model_dir / "lora", CORPUS, steps=4, seed=shape.seed,
                      targets=targets or "all-linear")  # type: ignore[arg-type]  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One cell's outcome: ``exact``, ``refused`` (before placement), ``crashed``, ``differs``;
    or, for the whole architecture, ``not built`` or ``hf fails`` (layout and dtype ``-``)."""

    model_type: str
    layout: str
    dtype: str
    outcome: str
    detail: str = ""
    strategy: str = ""
    seconds: float = 0.0
    shape: str = ""
    seed: int = 0

    @property
    def failed(self) -> bool:
        return self.outcome in ("crashed", "differs")


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Raise :class:`_Timeout` in this (the main) thread after ``seconds``: a hang is a failure
    with its own name, not a run that never ends."""

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cell(
    shape: Shape,
    model_dir: Path,
    adapter: Path | None,
    spread: Any,
    layout: str,
    task_manager: Any,
    timeout_s: int = 600,
) -> Cell:
    """rayeval on ``model_dir`` at ``layout`` in ``spread``'s dtype, judged against ``spread``
    (lm-eval hf's runs at three batch sizes)."""
    import ray

    from rayeval.actors.errors import ConfigError, LayoutError
    from rayeval.service.engine.lm import RayEvalLM
    from tests.helpers import evaluate

    replicas, shard_size, strategy = LAYOUTS[layout]
    base = {"model_type": shape.model_type, "layout": layout, "dtype": spread.dtype,
            "shape": shape.describe(), "seed": shape.seed}  # fmt: skip
    groups_before = len(ray.util.placement_group_table())
    start = time.perf_counter()
    used = ""
    try:
        with _deadline(timeout_s), RayEvalLM(
            pretrained=str(model_dir), num_replicas=replicas, shard_size=shard_size,
            shard_strategy=strategy, dtype=spread.dtype, batch_size="auto",
            max_batch_tokens=256, **({"peft": str(adapter)} if adapter else {}),
        ) as lm:  # fmt: skip
            used = lm.engine.shard_strategy.value
            ours = evaluate(lm, task_manager, TASKS, **RUN)
    except (ConfigError, LayoutError) as exc:
        placed = len(ray.util.placement_group_table()) != groups_before
        outcome = "crashed" if placed else "refused"
        detail = ("refused after its ranks were placed: " if placed else "") + str(exc)
        return Cell(**base, outcome=outcome, detail=detail, strategy=used,
                    seconds=time.perf_counter() - start)  # fmt: skip
    except Exception as exc:  # a crash of any kind is this cell's finding
        return Cell(**base, outcome="crashed", detail=_last_line(exc), strategy=used,
                    seconds=time.perf_counter() - start)  # fmt: skip
    seconds = time.perf_counter() - start
    judgement = spread.judge(ours)
    if judgement.holds:
        detail = f"nearest {judgement.figures('nearest')}, spread {judgement.figures('spread')}"
        return Cell(**base, outcome="exact", detail=detail, strategy=used, seconds=seconds)
    detail = f"{judgement.beyond} at {', '.join(judgement.where[:6])}"
    return Cell(**base, outcome="differs", detail=detail, strategy=used, seconds=seconds)


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:400]


def run_architecture(
    model_type: str,
    seed: int,
    root: Path,
    tokenizer_dir: Path,
    task_manager: Any,
    layouts: list[str] | None = None,
    dtypes: tuple[str, ...] = DTYPES,
) -> Iterator[Cell]:
    """Every cell of ``model_type`` (``layouts``: these alone), one by one as they finish."""
    from rayeval.service.parity import SPREAD_BATCH_SIZES, Spread
    from tests.helpers import hf_reference

    model_dir = root / f"{model_type}-{seed}"
    try:
        shape = build_drawn(model_type, seed, model_dir, tokenizer_dir)
    except Exception as exc:  # the generator's gap, not rayeval's
        yield Cell(model_type, "-", "-", "not built", _last_line(exc),
                   shape=draw_shape(model_type, seed).describe(), seed=seed)  # fmt: skip
        return
    adapter = None
    if shape.lora:
        try:
            adapter = train_adapter(shape, model_dir)
        except Exception as exc:
            yield Cell(model_type, "-", "-", "not built", "LoRA: " + _last_line(exc),
                       shape=shape.describe(), seed=seed)  # fmt: skip
            return
    model_args = {"peft": str(adapter)} if adapter else {}
    for dtype in dtypes:
        try:
            runs = tuple(
                hf_reference(model_dir, task_manager, TASKS, dtype, size, model_args, **RUN)
                for size in SPREAD_BATCH_SIZES
            )
        except Exception as exc:
            yield Cell(model_type, "-", dtype, "hf fails", _last_line(exc),
                       shape=shape.describe(), seed=seed)  # fmt: skip
            continue
        spread = Spread(model_type, dtype, SPREAD_BATCH_SIZES, runs)
        auto_at_2 = ""
        for layout in layouts or list(LAYOUTS):
            if auto_at_2 and layout == f"1x2 {auto_at_2}":
                continue  # the default strategy's cell (1x2) is this one
            cell = run_cell(shape, model_dir, adapter, spread, layout, task_manager)
            if layout == "1x2":
                auto_at_2 = cell.strategy
            yield cell


def cpu_name() -> str:
    """The machine's CPU model and the kernels torch picks on it."""
    import torch

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    capability = torch.backends.cpu.get_cpu_capability()
    capped = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
              if k in os.environ]  # fmt: skip
    return f"{name} ({os.cpu_count()} CPUs), ATen kernels {capability}" + (
        f", capped by {' '.join(capped)}" if capped else ""
    )


DTYPE_NAMES = {"float32": "f32", "bfloat16": "bf16"}
SYMBOLS = {"exact": "✓", "refused": "R", "crashed": "✗ crash", "differs": "✗ differs"}


def write_markdown(cells: list[Cell], path: Path, seed: int, elapsed_s: float) -> None:
    """``docs/conformance.md``: the matrix (architecture x layout x dtype), the machine, then
    every refusal, failure and gap with its reason."""
    import lm_eval
    import torch
    import transformers

    columns = [(layout, dtype) for dtype in DTYPES for layout in LAYOUTS]
    by_arch: dict[str, dict[tuple[str, str], Cell]] = {}
    gaps: dict[str, list[Cell]] = {}
    for cell in cells:
        if cell.layout == "-":
            gaps.setdefault(cell.model_type, []).append(cell)
        else:
            by_arch.setdefault(cell.model_type, {})[(cell.layout, cell.dtype)] = cell
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell.outcome] = counts.get(cell.outcome, 0) + 1
    archs = sorted({c.model_type for c in cells})
    lines = [
        "# Conformance matrix",
        "",
        "Generated by `make conformance` (`tests/conformance.py`): every architecture the",
        "installed transformers gives a tensor-parallel plan and a causal-LM class, plus GPT-2 and",
        "GPT-NeoX, as a tiny random model with hostile shapes drawn per architecture (seed below);",
        "each cell is rayeval against lm-eval hf on all four request types of the demo tasks",
        "(`--limit 3`, one few-shot example), continuous batching and shared prefixes on. Do not",
        "edit by hand.",
        "",
        f"- Machine: {cpu_name()}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lm-eval {lm_eval.__version__}; seed {seed}; {len(archs)} of "
        f"{len(architectures())} architectures, {elapsed_s / 60:.0f} minutes of cells",
        "- Cells: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        "",
        "The matrix tries tensor parallelism on every architecture (`RAYEVAL_UNCHECKED_TP=1`);",
        "rayeval itself runs `tp` (and `auto` picks it) only where it was checked against lm-eval",
        f"hf: {', '.join(_tp_checked())}. Elsewhere `auto` picks FSDP (the `1x2 fsdp` column)",
        "and `tp` is refused before placement: a ✗ in a tp cell of another architecture is what",
        "that refusal prevents.",
        "",
        "✓: within the bound (per measure no further from lm-eval hf than lm-eval hf is from",
        "itself between batch sizes 1, 4 and 16; in float32 also every log-prob within 1e-4 or two",
        "ulps); R: refused before any rank was placed (reason below); ✗: crashed or differs;",
        "= 1x2: the strategy auto picked at 1x2, so that cell is the 1x2 one; blank: not run.",
        "",
        "| architecture | shape drawn | "
        + " | ".join(f"{lay} {DTYPE_NAMES[d]}" for lay, d in columns)
        + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    lines += _table_rows(archs, cells, by_arch, gaps, columns)
    lines += ["", "## Refusals", ""]
    refusals: dict[str, list[str]] = {}
    for cell in cells:
        if cell.outcome == "refused":
            refusals.setdefault(cell.detail, []).append(
                f"{cell.model_type} {cell.layout} {cell.dtype}"
            )
    lines += [f"- {reason} ({'; '.join(where)})" for reason, where in refusals.items()] or ["None."]
    lines += [
        "",
        "## Failures",
        "",
        "Cells the matrix found failing and that were fixed are kept as tests (`FOUND` in",
        "`tests/test_conformance.py`). A failure below is open unless it is a tp cell of an",
        "architecture tp is not checked on (refused by rayeval itself, see above).",
        "",
    ]
    failures = [c for c in cells if c.failed]
    lines += [
        f"- {c.model_type} {c.layout} {c.dtype} (seed {c.seed}): {c.outcome}: {c.detail}"
        for c in failures
    ] or ["None."]
    missing = [arch for arch in architectures() if arch not in by_arch and arch not in gaps]
    if missing:
        lines += ["", f"## Not run yet ({len(missing)} architectures)", "",
                  "`make conformance CONFORMANCE_ARGS=--resume` goes on with them: "
                  + ", ".join(missing) + "."]  # fmt: skip
    lines += ["", "## Not measured (the generator's or lm-eval hf's gap, not rayeval's)", ""]
    lines += [
        f"- {c.model_type}{' ' + c.dtype if c.dtype != '-' else ''}: {c.outcome}: {c.detail}"
        for arch in sorted(gaps)
        for c in gaps[arch]
    ] or ["None."]
    path.write_text("\n".join(lines) + "\n")


def _tp_checked() -> list[str]:
    """The architectures rayeval runs tensor parallelism on (``ModelProfile.tensor_parallel``)."""
    from rayeval.actors.profiles import PROFILES

    return sorted(name for name, profile in PROFILES.items() if profile.tensor_parallel)


def _table_rows(
    archs: list[str],
    cells: list[Cell],
    by_arch: dict[str, dict[tuple[str, str], Cell]],
    gaps: dict[str, list[Cell]],
    columns: list[tuple[str, str]],
) -> list[str]:
    """The matrix's rows: one per architecture, a mark per (layout, dtype)."""
    lines = []
    for arch in archs:
        row = by_arch.get(arch, {})
        shape = next((c.shape for c in cells if c.model_type == arch), "")
        marks = []
        for layout, dtype in columns:
            cell = row.get((layout, dtype))
            auto = row.get(("1x2", dtype))
            if cell is None and auto is not None and layout == f"1x2 {auto.strategy}":
                marks.append("= 1x2")
            else:
                marks.append(SYMBOLS.get(cell.outcome, cell.outcome) if cell else "")
        if arch in gaps and not row:
            marks = [gaps[arch][0].outcome] + [""] * (len(columns) - 1)
        lines.append(f"| {arch} | {shape} | " + " | ".join(marks) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``make conformance``: run the matrix, append each cell to ``OUT/cells.jsonl`` as it
    finishes (a rerun with ``--resume`` skips the architectures already there) and write the
    markdown. Exit 1 when a cell crashed or differs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the shapes (default 0)")
    parser.add_argument("--only", nargs="*", help="these model types (default: every one)")
    parser.add_argument("--sample", type=int, default=0,
                        help="add N architectures drawn by --seed to --only's")  # fmt: skip
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="default: all")
    parser.add_argument("--dtypes", nargs="*", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--out", type=Path, default=Path(".rayeval/conformance"))
    parser.add_argument("--markdown", type=Path, default=Path("docs/conformance.md"))
    parser.add_argument("--resume", action="store_true", help="keep OUT/cells.jsonl's cells")
    parser.add_argument("--probe", action="store_true", help="only build every architecture")
    parser.add_argument("--report", action="store_true",
                        help="only write the markdown of OUT/cells.jsonl's cells")  # fmt: skip
    args = parser.parse_args(argv)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    from rayeval.service.demo import ensure_demo_assets

    args.out.mkdir(parents=True, exist_ok=True)
    demo = ensure_demo_assets(args.out / "demo")
    chosen = list(args.only or ([] if args.sample else architectures()))
    others = [a for a in architectures() if a not in chosen]
    chosen += random.Random(args.seed).sample(others, min(args.sample, len(others)))
    if args.probe:
        return _probe(chosen, args.seed, args.out / "models", demo.model_dir)
    if args.report:
        record = args.out / "cells.jsonl"
        cells = [Cell(**json.loads(line)) for line in record.read_text().splitlines()]
        elapsed_s = sum(cell.seconds for cell in cells)
    else:
        cells, elapsed_s = _run_matrix(args, chosen, demo)
    write_markdown(cells, args.markdown, args.seed, elapsed_s)
    print(f"wrote {args.markdown}")
    return 1 if any(c.failed for c in cells) else 0


def _probe(chosen: list[str], seed: int, root: Path, tokenizer_dir: Path) -> int:
    """Build each architecture's drawn model and say which the generator cannot build."""
    failed = 0
    for model_type in chosen:
        try:
            shape = build_drawn(model_type, seed, root / model_type, tokenizer_dir)
            print(f"ok   {model_type:28s} {shape.describe()}")
        except Exception as exc:  # the probe reports every failure
            failed += 1
            print(f"FAIL {model_type:28s} {_last_line(exc)[:200]}")
    print(f"{failed} of {len(chosen)} not built")
    return 0


def _run_matrix(args: argparse.Namespace, chosen: list[str], demo: Any) -> tuple[list[Cell], float]:
    """Every cell of ``chosen``'s architectures on one local Ray, and the minutes it took."""
    import datasets
    import ray
    import transformers
    from lm_eval.tasks import TaskManager

    from rayeval.actors.parallel.tensor_parallel import UNCHECKED_ENV

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # tp is tried on every architecture, not only those it was checked on: that is how they
    # are checked (the CI's draw, tests/test_conformance.py, runs as users do).
    os.environ[UNCHECKED_ENV] = "1"
    record = args.out / "cells.jsonl"
    cells = [Cell(**json.loads(line)) for line in record.read_text().splitlines()] if (
        args.resume and record.exists()) else []  # fmt: skip
    if not args.resume:
        record.write_text("")
    done = {c.model_type for c in cells}
    task_manager = TaskManager(include_defaults=False, include_path=str(demo.tasks_dir))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    try:
        for model_type in chosen:
            if model_type in done:
                continue
            for cell in run_architecture(model_type, args.seed, args.out / "models",
                                         demo.model_dir, task_manager, args.layouts,
                                         tuple(args.dtypes)):  # fmt: skip
                cells.append(cell)
                with record.open("a") as file:
                    file.write(json.dumps(asdict(cell)) + "\n")
                print(f"{cell.model_type:24s} {cell.layout:9s} {cell.dtype:9s} {cell.outcome:9s} "
                      f"{cell.seconds:5.1f}s {cell.detail[:160]}", flush=True)  # fmt: skip
    finally:
        ray.shutdown()
    return cells, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
