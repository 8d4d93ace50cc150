"""The vocabulary matrices of a model evaluated with a LoRA adapter whose tokenizer has another
length than the base's vocabulary, resized as lm-eval's hf backend resizes them.

With ``peft=``, lm-eval calls ``resize_token_embeddings(len(tokenizer))`` on the base whenever
the config's ``vocab_size`` differs from the tokenizer's length, before PEFT applies the
adapter. Two cases reach it:

* **shrinking** (a vocabulary padded beyond the tokenizer, as Qwen's 151,936 rows for 151,665
  tokens): the first ``len(tokenizer)`` rows of the embeddings and of the head are kept. It
  changes log-probabilities (the softmax runs over fewer tokens), so the ranks do it too.
* **growing** (a tokenizer with added tokens): the new rows are drawn at random around the
  mean, then overwritten by the matrices the adapter saved (PEFT saves the whole embeddings and
  head when the vocabulary was resized in training, ``save_embedding_layers="auto"``). Only
  such adapters are evaluated (:func:`resize_problems`): without saved matrices lm-eval's
  answers depend on its random draw.

Every layout does the same: the model is resized by transformers' own
``resize_token_embeddings`` (:func:`resize_whole`), a whole one after loading, a sharded one on
the meta device before it is cut into shards, whose ranks then read the base's rows they hold
(all of which exist when shrinking). Setting the config's ``vocab_size`` instead is not the
same: a model may size its head from another field (Inkling 2's ``unpadded_vocab_size``), which
then kept a row more than lm-eval's resized head and moved every log-prob. Then the matrices
an adapter saved overwrite the rows each rank holds (:func:`fill_saved_matrices`), by the region
machinery of :mod:`rayeval.actors.weights.sources` (whole tensors, FSDP2's dim-0 shards,
vocabulary chunks alike).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError, ModelLoadError

#: What PEFT prefixes the names of the base model's tensors with in an adapter file.
ADAPTER_PREFIX = "base_model.model."
_SAVE_FIX = (
    "save the adapter with save_embedding_layers=True (PEFT's save_pretrained; the default "
    '"auto" does it when the embeddings were resized in training) so that the new tokens\' '
    "embeddings travel with it"
)


def config_rows(config: Any) -> int | None:
    """The vocabulary size a model config gives (a multimodal model's text config's)."""
    rows = getattr(getattr(config, "text_config", config), "vocab_size", None)
    return int(rows) if rows is not None else None


def resized_rows(config: Any, tokens: int) -> int | None:
    """The row count lm-eval resizes the vocabulary matrices to for a ``peft=`` adapter over a
    model of ``config`` with a tokenizer of ``tokens``: None when it does not resize."""
    rows = config_rows(config)
    return tokens if rows is not None and rows != tokens else None


def vocabulary_matrices(model: Any) -> list[tuple[str, ...]]:
    """The model's vocabulary matrices, each by every parameter name a checkpoint may give it
    (``("model.embed_tokens.weight",)``, ``("lm_head.weight",)``; a tied head shares the
    embedding's entry), also where a sharded rank holds them in vocabulary chunks."""
    modules = {id(module): name for name, module in model.named_modules()}
    matrices: dict[int, tuple[str, ...]] = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        first = next(iter(module.parameters()), None) if module is not None else None
        if first is None or id(module) not in modules:
            continue
        name = f"{modules[id(module)]}.weight" if modules[id(module)] else "weight"
        matrices[id(first)] = (*matrices.get(id(first), ()), name)
    return list(matrices.values())


def saved_matrices(model: Any, keys: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The adapter file's tensors (of ``keys``) that are ``model``'s vocabulary matrices, each
    with the matrix's names."""
    names = {name: matrix for matrix in vocabulary_matrices(model) for name in matrix}
    return {
        key: names[key.removeprefix(ADAPTER_PREFIX)]
        for key in keys
        if key.removeprefix(ADAPTER_PREFIX) in names
    }


def resize_problems(
    path: str, shell: Any, tokens: int, shapes: Mapping[str, Sequence[int]]
) -> None:
    """Refuse a resize the ranks cannot make give lm-eval's answers: a tokenizer longer than
    the vocabulary (added tokens) whose adapter did not save every vocabulary matrix, or a saved
    matrix whose row count is not the tokenizer's length.

    Args:
        path: The adapter folder (for messages).
        shell: The weightless model of ``pretrained``.
        tokens: The tokenizer's length.
        shapes: The adapter file's tensors and their shapes.

    Raises:
        ConfigError: naming ``peft=`` and the fix.
    """
    saved = saved_matrices(shell, shapes)
    for key in saved:
        if tuple(shapes[key][:1]) != (tokens,):
            raise ConfigError(
                f"peft={path}: the adapter saved {key} with {shapes[key][0]} rows, but the "
                f"tokenizer has {tokens} tokens: pass the tokenizer the adapter was trained "
                "with in tokenizer= (the adapter's folder, if it was saved there)"
            )
    rows = config_rows(shell.config)
    if rows is None or tokens <= rows:
        return
    covered = set(saved.values())
    missing = [m[0] for m in vocabulary_matrices(shell) if m not in covered]
    if missing:
        raise ConfigError(
            f"peft={path}: the tokenizer has {tokens} tokens, {tokens - rows} more than "
            f"pretrained's model ({rows}), and the adapter saved no {' or '.join(missing)} for "
            "them (lm-eval gives them random embeddings, so its answers cannot be reproduced): "
            f"{_SAVE_FIX}"
        )


def resize_whole(model: Any, rows: int) -> None:
    """Resize a model's vocabulary matrices (whole, or on the meta device before sharding) with
    transformers' own ``resize_token_embeddings``, as lm-eval does (the first ``min(old, rows)``
    rows kept).
    Added rows are left as ``_init_weights`` draws them (not lm-eval's mean-centred draw):
    :func:`fill_saved_matrices` overwrites them (:func:`resize_problems` saw to it)."""
    model.resize_token_embeddings(rows, mean_resizing=False)


def fill_saved_matrices(
    model: Any, path: str, file: Path, shapes: Mapping[str, Sequence[int]]
) -> int:
    """Overwrite the vocabulary rows this rank holds of ``model`` (whole, FSDP2-sharded, or in
    vocabulary chunks) with the matrices the adapter at ``path`` saved in its weight ``file``
    (whose tensors have ``shapes``), in the parameter's dtype. Nothing when it saved none.

    Returns:
        Bytes written.

    Raises:
        ModelLoadError: a saved matrix has another shape than the model's.
    """
    import torch

    from rayeval.actors.weights.dcp import Region
    from rayeval.actors.weights.hf_files import Checkpoint, match_key
    from rayeval.actors.weights.sources import slots

    stripped = {key.removeprefix(ADAPTER_PREFIX): key for key in saved_matrices(model, shapes)}
    if not stripped:
        return 0
    regions = []
    for slot in slots(model):
        name = match_key(slot.aliases, stripped, "")
        if name is None:
            continue
        key = stripped[name]
        if tuple(shapes[key]) != slot.shape:
            raise ModelLoadError(
                f"peft={path}: tensor {key} has shape {tuple(shapes[key])}, the model's "
                f"{slot.aliases[0]} is {slot.shape}"
            )
        regions.append(Region(key, slot.local, slot.offsets))
    if not regions:
        return 0
    checkpoint = Checkpoint(
        dict.fromkeys((r.key for r in regions), file), safetensors=file.suffix == ".safetensors"
    )
    with checkpoint.reader() as reader, torch.no_grad():
        for region in regions:
            region.dest.copy_(reader.region(region.key, region.offsets, region.dest.shape))
    return sum(r.dest.numel() * r.dest.element_size() for r in regions)
