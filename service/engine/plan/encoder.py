"""The driver's tokeniser: lm-eval's own ``HFLM`` over a weightless copy of the model.

Every tokeniser rule lm-eval's HF backend applies (BOS handling, pad token, chat templates, max
length, thinking tokens) is its own code here: :func:`build_encoder` builds an ``HFLM`` over a
meta-device model, which holds no weights. :func:`generate_request` tokenises one
``generate_until`` request and :func:`decode_generation` turns generated ids back into lm-eval's
answer text, both as lm-eval's ``generate_until`` does; :func:`model_spec` says how the ranks load
the model the encoder describes. :func:`encode_pairs` tokenises loglikelihood pairs as lm-eval's
``TemplateLM.loglikelihood`` does, in bulk: each context string once, one batch call into a fast
tokenizer for many strings, token ids shared rather than copied.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy
import torch
import transformers
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ConfigError, field
from rayeval.actors.weights.hf_files import read_generation_config, resolve_dtype
from rayeval.service.engine.plan.generation_planner import GenerateRequest
from rayeval.service.vocabulary.lm_eval_options import ENCODER_MODEL_ARGS, looks_local

logger = logging.getLogger(__name__)

#: Pairs tokenised per batch call (bounds the memory of their joint encodings).
ENCODE_CHUNK = 4096

#: Model args the ranks' ModelSpec carries in its own fields (the rest go to from_pretrained).
_SPEC_FIELDS = ENCODER_MODEL_ARGS | {
    "revision",
    "subfolder",
    "trust_remote_code",
    "dtype",
    "backend",
    "logits_cache",
    "softmax_dtype",
    "mixed_precision_dtype",
    "checkpoint",
    "peft",
    "delta",
}


def build_encoder(pretrained: str, model_args: dict[str, Any]) -> tuple[HFLM, torch.dtype]:
    """lm-eval's own HFLM over a weightless copy of the model, and the model's dtype.

    Raises:
        ConfigError: the model's config cannot be found.
    """
    shell, dtype = meta_model(pretrained, model_args)
    encoder_kwargs = {k: v for k, v in model_args.items() if k in ENCODER_MODEL_ARGS}
    encoder_kwargs.setdefault("tokenizer", pretrained)
    encoder = HFLM(pretrained=shell, backend="causal", **_common(model_args), **encoder_kwargs)
    return encoder, dtype


def meta_model(pretrained: str, model_args: dict[str, Any]) -> tuple[Any, torch.dtype]:
    """The model of ``pretrained``'s config on the meta device (no weights), with the generation
    config ``from_pretrained`` reads beside it, and its dtype.

    Raises:
        ConfigError: the model's config cannot be found.
    """
    common = _common(model_args)
    folder = os.path.expanduser(pretrained)
    if looks_local(pretrained) and not os.path.exists(folder):
        # transformers would read it as a hub id and explain what a repo id may contain
        raise ConfigError(
            f"no such folder: {folder!r} (pretrained={pretrained}): give the folder that holds "
            "the model's config.json, or a Hugging Face hub id (org/name)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(pretrained, **common)
    except OSError as exc:
        raise ConfigError(
            f"cannot load model {pretrained!r}: {str(exc).rstrip('.')}. Pass an existing local "
            "path or a Hugging Face hub id as pretrained=..."
        ) from exc
    dtype = resolve_dtype(model_args.get("dtype", "auto"), config)
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=common["trust_remote_code"]
        )
    # As the ranks' models read it: what the driver decides from the shell (continuous or static
    # batching) depends on the settings ``generate`` will apply.
    generation = read_generation_config(pretrained, common["revision"], common["subfolder"])
    if generation is not None:
        shell.generation_config = generation
    return shell, dtype


def _common(model_args: dict[str, Any]) -> dict[str, Any]:
    return {
        "revision": str(model_args.get("revision", "main")),
        "subfolder": model_args.get("subfolder", ""),
        "trust_remote_code": bool(model_args.get("trust_remote_code", False)),
    }


class _ModelObjectWarnings(logging.Filter):
    """lm-eval's HF backend warns when it is handed a model object instead of a name (other model
    args may be ignored; not for ``accelerate``). rayeval always hands it its weightless shell
    (:func:`build_encoder`), with the args that shape tokenisation given to ``HFLM`` itself,
    and the ranks load the weights: these warnings say nothing about the evaluation, so they are
    dropped."""

    MESSAGES = (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model through `pretrained`",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.MESSAGES)


logging.getLogger(HFLM.__module__).addFilter(_ModelObjectWarnings())


def model_spec(
    pretrained: str, model_args: dict[str, Any], pad_token_id: int, vocab_size: int | None = None
) -> ModelSpec:
    """How every rank loads the model (``pad_token_id``: the encoder's, after lm-eval's fix-up;
    ``vocab_size``: the resized vocabulary of a ``peft=`` adapter, None: the config's)."""
    tokenizer = model_args.get("tokenizer")
    return ModelSpec(
        pretrained=pretrained,
        revision=str(model_args.get("revision", "main")),
        subfolder=model_args.get("subfolder", ""),
        dtype=str(model_args.get("dtype", "auto")),
        trust_remote_code=bool(model_args.get("trust_remote_code", False)),
        tokenizer=tokenizer if isinstance(tokenizer, str) else None,
        pad_token_id=pad_token_id,
        softmax_dtype=model_args.get("softmax_dtype"),
        mixed_precision_dtype=model_args.get("mixed_precision_dtype"),
        extra_kwargs={k: v for k, v in model_args.items() if k not in _SPEC_FIELDS},
        checkpoint=str(model_args["checkpoint"]) if model_args.get("checkpoint") else None,
        peft=str(model_args["peft"]) if model_args.get("peft") else None,
        delta=str(model_args["delta"]) if model_args.get("delta") else None,
        vocab_size=vocab_size,
    )


def generate_request(
    encoder: HFLM, context: str, gen_kwargs: dict[str, Any], eos: str
) -> GenerateRequest:
    """Tokenise one generate_until request as lm-eval's HF ``generate_until`` does.

    Raises:
        ConfigError: ``max_gen_toks`` leaves no room for a context.
    """
    kwargs = normalize_gen_kwargs(gen_kwargs, encoder.max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = kwargs.pop("max_gen_toks")
    max_length = kwargs.pop("max_length", None)
    max_ctx_len = encoder.max_length - max_gen_toks
    if max_ctx_len <= 0:
        raise ConfigError(
            f"max_gen_toks ({max_gen_toks}) must be below the model's max_length "
            f"({encoder.max_length}): lower max_gen_toks in {field('gen_kwargs')} or the task"
        )
    # tok_batch_encode's rules for one string: BOS-prefixed text gets no special tokens.
    tokenizer = encoder.tokenizer
    special: dict[str, bool] = {}
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        special = {"add_special_tokens": False}
    elif encoder.add_bos_token is not None:
        special = {"add_special_tokens": encoder.add_bos_token}
    ids = tokenizer(context, truncation=encoder.truncation, **special)["input_ids"]
    return GenerateRequest(
        context=shared_ids(encoder)(ids[-max_ctx_len:]),
        max_gen_toks=max_gen_toks,
        until=tuple(until),
        max_length=max_length,
        kwargs=kwargs,
    )


def generate_requests(
    encoder: HFLM, args: Sequence[tuple[str, dict[str, Any]]], eos: str
) -> list[GenerateRequest]:
    """:func:`generate_request` of each (context, gen_kwargs) (what a tokeniser actor runs)."""
    return [generate_request(encoder, context, gen_kwargs, eos) for context, gen_kwargs in args]


def generation_settings(encoder: HFLM, gen_kwargs: dict[str, Any]) -> tuple[int | None, Any]:
    """(max_length, the remaining generation kwargs) of a generate_until request, as
    :func:`generate_request` makes them, without tokenising its context."""
    kwargs = normalize_gen_kwargs(gen_kwargs, encoder.max_gen_toks)
    for name in ("until", "max_gen_toks"):
        kwargs.pop(name, None)
    return kwargs.pop("max_length", None), kwargs


def rolling_windows(encoder: HFLM, strings: Sequence[str]) -> tuple[list[Any], list[int]]:
    """lm-eval's disjoint rolling windows of each document, all in one list, and how many each
    document has (as lm-eval's HF ``loglikelihood_rolling`` cuts them)."""
    windows: list[tuple[list[int], list[int]]] = []
    counts = []
    for string in strings:
        doc_windows = [
            make_disjoint_window(window)
            for window in get_rolling_token_windows(
                token_list=encoder.tok_encode(string),
                prefix_token=encoder.prefix_token_id,
                max_seq_len=encoder.max_length,
                context_len=1,
            )
        ]
        windows += doc_windows
        counts.append(len(doc_windows))
    return windows, counts


def decode_generation(encoder: HFLM, generated: Sequence[int], until: Sequence[str]) -> str:
    """lm-eval's answer text for generated token ids: after the last think-end token, decoded,
    cut at the first stop string."""
    think_end = encoder.think_end_token
    tokens = list(generated)
    if isinstance(think_end, int) and think_end in tokens:
        tokens = tokens[len(tokens) - tokens[::-1].index(think_end) :]
    text = encoder.tok_decode(tokens)
    if isinstance(think_end, int):
        text = text.lstrip()
    return postprocess_generated_text(
        generation=text,
        stop=list(until),
        think_end_token=think_end if isinstance(think_end, str) else None,
    )


def model_sha(pretrained: str, revision: str) -> str:
    """The hub commit of the model, as lm-eval records it; empty for local paths or offline."""
    if os.path.isdir(pretrained) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return ""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id=pretrained, revision=revision).sha or ""
    except Exception:  # lm-eval records "" whenever the hub cannot say
        return ""


@dataclass(frozen=True)
class EncodedPairs:
    """Tokenised loglikelihood pairs, as lm-eval's ``TemplateLM.loglikelihood`` makes them.

    Attributes:
        pairs: Per request, its context and continuation token ids. Requests with the same
            context string share one context tuple; every id is one shared int object.
        merged: Per request, whether the joint encoding does not start with the context's own
            tokens (:class:`rayeval.service.engine.plan.checks.RequestIssue`'s ``merged_boundary``).
        sources: Refs to the tokeniser actors' results these pairs were joined from, in order
            (:mod:`rayeval.service.engine.plan.tokenisers`; empty: tokenised here).
    """

    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]
    merged: list[bool]
    sources: tuple[Any, ...] = ()

    def requests(self, strings: Sequence[tuple[str, str]]) -> list[Any]:
        """lm-eval's tokenised requests: ``((context, continuation), ctx_enc, cont_enc)``."""
        return [(pair, *tokens) for pair, tokens in zip(strings, self.pairs, strict=True)]


def encode_pairs(encoder: HFLM, requests: Sequence[tuple[str, str]]) -> EncodedPairs:
    """Tokenise (context, continuation) pairs exactly as lm-eval's causal ``loglikelihood``.

    lm-eval moves a context's trailing spaces to the continuation, encodes context and
    context + continuation, and takes the continuation's ids from the joint encoding past the
    context's length; an empty context conditions on the prefix token. Here each distinct context
    is encoded once (the choices of a question share it), strings are encoded in batches
    (:func:`tok_encode_many`), and the joint encodings are dropped once used.
    """
    shared = shared_ids(encoder)
    pairs: list[Any] = [None] * len(requests)
    merged = [False] * len(requests)
    contexts: dict[str, tuple[int, ...]] = {}
    split: list[tuple[int, str, str]] = []
    for index, (context, continuation) in enumerate(requests):
        if context == "":
            pairs[index] = _empty_context_pair(encoder, continuation, shared)
            continue
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        split.append((index, context, continuation))
    for start in range(0, len(split), ENCODE_CHUNK):
        chunk = split[start : start + ENCODE_CHUNK]
        new = list(dict.fromkeys(c for _, c, _ in chunk if c not in contexts))
        contexts.update(zip(new, map(shared, tok_encode_many(encoder, new)), strict=True))
        wholes = tok_encode_many(encoder, [context + cont for _, context, cont in chunk])
        for (index, context, _), whole in zip(chunk, wholes, strict=True):
            ctx = contexts[context]
            pairs[index] = (ctx, shared(whole[len(ctx) :]))
            merged[index] = shared(whole[: len(ctx)]) != ctx
    return EncodedPairs(pairs, merged)


def tok_encode_many(encoder: HFLM, strings: Sequence[str]) -> list[list[int]]:
    """``encoder.tok_encode(s)`` of each string, with lm-eval's rules (special tokens as
    ``add_bos_token`` says, none for a string that starts with the BOS text), in one batch call
    per rule into a fast tokenizer: that skips ``tokenizer.encode``'s per-call Python and runs on
    every core (``TOKENIZERS_PARALLELISM``). A slow tokenizer encodes string by string."""
    tokenizer = encoder.tokenizer
    if not strings or not getattr(tokenizer, "is_fast", False):
        return [encoder.tok_encode(string) for string in strings]
    bos = tokenizer.decode(encoder.prefix_token_id)
    plain = {} if encoder.add_bos_token is None else {"add_special_tokens": encoder.add_bos_token}
    by_rule: dict[bool, list[int]] = {}
    for index, string in enumerate(strings):
        by_rule.setdefault(has_bos_prefix(string, bos), []).append(index)
    encoded: list[list[int]] = [[] for _ in strings]
    for prefixed, indices in by_rule.items():
        kwargs = {"add_special_tokens": False} if prefixed else plain
        batch = [strings[i] for i in indices]
        ids = tokenizer(batch, return_attention_mask=False, **kwargs)["input_ids"]
        for index, tokens in zip(indices, ids, strict=True):
            encoded[index] = tokens
    if encoded[0] != encoder.tok_encode(strings[0]):  # a tokenizer whose batch call differs
        logger.warning("the tokenizer's batch encoding differs from tok_encode: one by one")
        return [encoder.tok_encode(string) for string in strings]
    return encoded


def _empty_context_pair(
    encoder: HFLM, continuation: str, shared: _Interner
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """lm-eval's pair for an empty context: the prefix token (or the continuation's first
    token, when it is the prefix token) as context."""
    cont = encoder.tok_encode(continuation, add_special_tokens=False)
    if encoder.prefix_token_id != cont[0]:
        return shared([encoder.prefix_token_id]), shared(cont)
    return shared(cont[:1]), shared(cont[1:])


def shared_ids(encoder: HFLM) -> _Interner:
    """The encoder's :class:`_Interner` (made once per encoder): token ids made elsewhere (a
    tokeniser actor's) become the driver's shared ones through it."""
    interner = _INTERNERS.get(encoder)
    if interner is None:
        interner = _INTERNERS[encoder] = _Interner(encoder)
    return interner


class _Interner:
    """Token ids as tuples of shared int objects (a tokenizer returns a new int per id: 36 bytes
    a token instead of 8), and one tuple per distinct short sequence (a choice's letter)."""

    def __init__(self, encoder: HFLM) -> None:
        size = max(len(encoder.tokenizer), int(getattr(encoder.tokenizer, "vocab_size", 0) or 0))
        self._ids = tuple(range(size))
        self._short: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._objects: Any = None  # the ids as a numpy object array, made on first use

    def __call__(self, ids: Sequence[int] | numpy.ndarray) -> tuple[int, ...]:
        """``ids`` (a numpy integer array, from a tokeniser actor, is read in one call)."""
        try:
            if isinstance(ids, numpy.ndarray):
                tokens = tuple(self._read(ids))
            else:
                tokens = tuple(map(self._ids.__getitem__, ids))
        except IndexError:  # an id past the vocabulary: kept as it is
            tokens = tuple(int(i) for i in ids)
        return self._short.setdefault(tokens, tokens) if len(tokens) <= 4 else tokens

    def many(self, flat: numpy.ndarray, offsets: Sequence[int]) -> list[tuple[int, ...]]:
        """Each ``flat[offsets[i]:offsets[i + 1]]`` as :meth:`__call__` makes it, the whole
        array read in one call (a tokeniser actor's continuations: a call per one-token
        sequence would cost more than the sequence)."""
        try:
            values = self._read(flat)
        except IndexError:
            return [self(flat[a:b]) for a, b in pairwise(offsets)]
        short, sequences = self._short, []
        for a, b in pairwise(offsets):
            tokens = tuple(values[a:b])
            sequences.append(short.setdefault(tokens, tokens) if b - a <= 4 else tokens)
        return sequences

    def _read(self, ids: numpy.ndarray) -> list[int]:
        """``ids`` as the shared int objects (IndexError: an id past the vocabulary)."""
        if self._objects is None:
            self._objects = numpy.array(self._ids, dtype=object)
        return self._objects[ids].tolist()  # type: ignore[no-any-return]


_INTERNERS: weakref.WeakKeyDictionary[HFLM, _Interner] = weakref.WeakKeyDictionary()
