"""What the driver decides from its weightless (meta-device) copy of the model, before any rank
starts: which strategies can shard it, whether continuous batching and packed rows reproduce
lm-eval's answers for it, and whether a training checkpoint, a LoRA adapter or delta weights fit
it.

Each is a small function of the shell (the encoder's meta model) and the engine's configuration,
so :class:`rayeval.service.engine.lm.RayEvalLM` only wires them together.
"""

from __future__ import annotations

import logging
from typing import Any

from rayeval.actors.errors import ConfigError, field
from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel.strategies import model_obstacles, refusal
from rayeval.actors.profiles import ModelShape
from rayeval.service.vocabulary.config import EngineConfig

logger = logging.getLogger(__name__)


def obstacles(
    shell: Any, config: EngineConfig, tokenizer: Any = None
) -> dict[ShardStrategy, list[str]]:
    """Per strategy, why it cannot shard this model at the configured G (``tokenizer``: the
    evaluation's, whose length decides whether a ``peft=`` adapter resizes the vocabulary).

    ``auto`` keeps FSDP for ``peft=``/``delta=``: tensor parallelism applies them when named
    (:func:`rayeval.actors.parallel.tp_exact.split_lora`), except a LoRA over a resized
    vocabulary or one that saved the embeddings and head (:func:`tp_adapter_problem`).

    Raises:
        ConfigError: the requested strategy cannot (before anything starts).
    """
    shard_size = config.parallelism.shard_size
    if shard_size == 1:
        return {}
    found = model_obstacles(shell.config, shard_size)
    requested = config.parallelism.shard_strategy
    if requested == ShardStrategy.TP:
        problem = tp_adapter_problem(config, shell, tokenizer)
        if problem is not None:
            raise ConfigError(problem)
    elif ShardStrategy.TP in found:
        for key in ("peft", "delta"):
            if config.model_args.get(key):
                found[ShardStrategy.TP] = [
                    *found[ShardStrategy.TP],
                    f"auto applies {key}= under FSDP (name shard_strategy tp for it)",
                ]
    if found.get(requested):
        raise ConfigError(refusal(requested, found[requested]))
    return found


def tp_adapter_problem(config: EngineConfig, shell: Any, tokenizer: Any) -> str | None:
    """Why tensor parallelism cannot apply this evaluation's ``peft=`` adapter (None: it can,
    as it can any ``delta=``): the tokenizer's length resizes the vocabulary, or the adapter
    saved the embeddings and head (PEFT's ``save_embedding_layers``); FSDP applies both."""
    from rayeval.actors.weights.adapters import adapter_shapes
    from rayeval.actors.weights.vocabulary import resized_rows, saved_matrices

    peft = config.model_args.get("peft")
    if not peft:
        return None
    try:
        saved = saved_matrices(shell, adapter_shapes(str(peft)))
    except ConfigError:
        return None  # no weights: check_adapters names the problem
    resized = tokenizer is not None and resized_rows(shell.config, len(tokenizer)) is not None
    if not saved and not resized:
        return None
    what = "resizes the vocabulary to the tokenizer" if resized else "saved the embeddings or head"
    return (
        f"peft={peft}: the adapter {what}, which shard_strategy tp does not apply: use "
        f"{field('parallelism', 'shard_strategy', value='fsdp')} (or auto) for it"
    )


def check_adapters(config: EngineConfig, shell: Any, tokenizer: Any) -> None:
    """Refuse a ``peft=`` adapter or ``delta=`` weights the ranks cannot apply to this model
    (before any rank starts; :mod:`rayeval.actors.weights.adapters`), with the tokenizer's
    vocabulary resize lm-eval makes for ``peft=`` (:func:`adapter_vocab_size`).

    Raises:
        ConfigError: naming the model arg and what to do.
    """
    from rayeval.actors.weights.adapters import adapter_problems, delta_problems

    args = config.model_args
    if args.get("peft"):
        whole = config.parallelism.shard_size == 1
        adapter_problems(str(args["peft"]), shell, len(tokenizer), whole=whole)
    if args.get("delta"):
        delta_problems(str(args["delta"]), shell, config.pretrained)


def adapter_vocab_size(config: EngineConfig, shell: Any, tokenizer: Any) -> int | None:
    """The row count the ranks resize the embeddings and head to, as lm-eval does for a
    ``peft=`` adapter when the model's vocabulary and the tokenizer's length differ (None: no
    resize; :mod:`rayeval.actors.weights.vocabulary`)."""
    from rayeval.actors.weights.vocabulary import resized_rows

    if not config.model_args.get("peft"):
        return None
    rows = resized_rows(shell.config, len(tokenizer))
    if rows is not None:
        logger.info(
            "peft=%s: the embeddings and head are resized to the tokenizer's %d tokens, as "
            "lm-eval resizes them",
            config.model_args["peft"],
            rows,
        )
    return rows


#: The one dtype in which packed rows and continuous batching give lm-eval hf's answers (see
#: :func:`packing_supported`, :func:`static_generation_reason`).
EXACT_DTYPE = "float32"


def static_generation_reason(
    config: EngineConfig, shell: Any, encoder: Any, dtype: Any
) -> str | None:
    """Why this evaluation generates in static batches only (None: continuous batching may run,
    request settings permitting).

    Continuous batching runs in float32 only (``dtype``: the model's ``torch.dtype``). Its decode
    steps run attention over the slots' cache, whose width and rows are not those of lm-eval
    hf's batch, and in bf16 and fp16 attention rounds by width (see :func:`packing_supported`):
    the conformance matrix found a GPT-2-style model whose bf16 greedy generation moved under
    continuous batching (the demo group's generation tasks sharing slots) where lm-eval hf's
    batch sizes 1, 4 and 16 agreed and rayeval's static batches gave lm-eval hf's tokens.
    """
    if not config.continuous_batching:
        return "continuous_batching is off"
    if str(dtype).removeprefix("torch.") != EXACT_DTYPE:
        return (
            f"the model computes in {str(dtype).removeprefix('torch.')}: continuous batching "
            "runs in float32 only (in bf16 and fp16 attention over the slots' cache rounds "
            "otherwise than over lm-eval hf's batch)"
        )
    shape = ModelShape(shell.config)
    if not shape.profile.continuous:
        return f"continuous batching is not checked for {shape.model_type!r} models"
    if encoder.think_end_token is not None:
        return "think_end_token is set (lm-eval cuts stop strings after the thinking part)"
    return None


def packing_supported(shell: Any, model_args: dict[str, Any], dtype: Any) -> bool:
    """Whether the ranks' model, computing in ``dtype``, scores packed rows with lm-eval hf's
    answers (else: one row per input).

    Only in float32. A packed row feeds a shared prefix to attention at the row's width, not at
    the width of lm-eval hf's padded row, and attention kernels round by width: on an AVX-512
    CPU (torch 2.13), bf16 ``scaled_dot_product_attention`` gives other bits for the first 12
    queries of a causal sequence of 16 or more keys than of one of 12-15, with no mask and with
    one alike (float32: 2e-7, far inside the fidelity bound). In bf16 and fp16 the product owes
    lm-eval hf's bits wherever lm-eval hf's own batch sizes agree, and a packed row's width is
    not one that lm-eval hf's batching would give the request. ``dtype``: a ``torch.dtype``.
    """
    if str(dtype).removeprefix("torch.") != EXACT_DTYPE:
        logger.info(
            "shared prefixes are computed once per request (not packed): the model computes in "
            "%s, where attention over a packed row's width rounds otherwise than over lm-eval "
            "hf's row (packing is exact in float32 only)",
            str(dtype).removeprefix("torch."),
        )
        return False
    implementation = model_args.get("attn_implementation") or getattr(
        shell.config, "_attn_implementation", None
    )
    reason = ModelShape(shell.config).packing_unsupported(implementation)
    if reason is not None:
        logger.info("shared prefixes are computed once per request (not packed): %s", reason)
    return reason is None


def check_checkpoint(checkpoint: str, shell: Any, pretrained: str) -> None:
    """Refuse a training checkpoint that cannot fill this model, naming the first problem: not
    a checkpoint, a half-written save (a DCP directory without its ``.metadata``), a tensor
    missing, a shape that the config does not give. Reads only the checkpoint's metadata (DCP)
    or file headers.

    Raises:
        CheckpointError: the checkpoint is unusable for this model (what to do is in the
            message).
    """
    from rayeval.actors.errors import CheckpointError, ModelLoadError
    from rayeval.actors.weights.sources import open_source, problems, refusal, slots

    try:
        source = open_source(checkpoint)
    except ModelLoadError as exc:
        raise CheckpointError(str(exc)) from None
    prefix = getattr(shell, "base_model_prefix", "")
    _, found = problems(slots(shell), source.shapes(), prefix)
    if found:
        raise CheckpointError(refusal(source.where, found, pretrained))
