"""FSDP2 units of a Hugging Face causal LM, and giving the unsharded parameters back.

``fully_shard`` makes every decoder block, the input embeddings and the output head their own
FSDP units (torchtitan's layout; tied embeddings and head are one unit, since they are one tensor),
then the root; every unit reshards after forward. On CPU ranks a large vocabulary matrix is cut
into row-chunk units of about a decoder block's size first
(:mod:`rayeval.actors.parallel.vocab_chunks`). Which modules are decoder blocks comes from the
architecture's profile (:mod:`rayeval.actors.profiles`) or the model's own ``_no_split_modules``.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from rayeval.actors.parallel.vocab_chunks import (
    ChunkedEmbedding,
    ChunkedHead,
    split_vocabulary,
    vocabulary_units,
)
from rayeval.actors.profiles import ModelShape

logger = logging.getLogger(__name__)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of any HF causal LM, innermost first.

    The architecture's profile names them where it knows better; else the model's own
    ``_no_split_modules`` (Llama, GPT-2, GPT-NeoX, Qwen2, Mistral all declare their decoder layer
    there; a private transformers attribute, listed in docs/architecture.md); else the children of
    the longest ``nn.ModuleList``.
    """
    config = getattr(model, "config", None)
    profile = ModelShape(config).profile if config is not None else None
    names = set(profile.block_classes if profile and profile.block_classes else ())
    names = names or set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) > len(blocks):
                blocks = list(module)
    # modules() is pre-order; FSDP2 wants nested modules sharded before their parents.
    return blocks[::-1]


def embedding_units(model: nn.Module) -> list[list[nn.Module]]:
    """The input embeddings and the output head as FSDP units: one each, or one together if tied.

    A tied head (GPT-2, Qwen2, Llama-3.2: ``lm_head.weight`` *is* the embedding weight) must be in
    the same unit as the embeddings: FSDP2 refuses one parameter in two units, and a unit holding
    only the embedding would leave the head pointing at the unsharded original.
    """
    try:
        embed = model.get_input_embeddings()  # type: ignore[operator]
        head = model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return []
    if isinstance(embed, ChunkedEmbedding):  # its chunks are units (vocabulary_units)
        embed = None
    if isinstance(head, ChunkedHead):
        head = None
    if not isinstance(embed, nn.Module) or not any(True for _ in embed.parameters()):
        if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
            return [[head]]
        return []
    if not isinstance(head, nn.Module) or not any(True for _ in head.parameters()):
        return [[embed]]
    embed_params = {id(p) for p in embed.parameters()}
    if any(id(p) in embed_params for p in head.parameters()):
        return [[embed, head]]
    return [[embed], [head]]


def shard_model(model: nn.Module, mesh: DeviceMesh) -> dict[str, tuple[nn.Parameter, int]]:
    """Apply FSDP2: each decoder block, the embeddings and the head, then the root.

    On CPU ranks a vocabulary matrix larger than a decoder block is first cut into row chunks of
    about a block's size, each its own unit (:mod:`rayeval.actors.parallel.vocab_chunks`): it is
    then never held twice while FSDP copies it out, the embedding never holds more than a chunk, and
    the head multiplies chunk by chunk where every rank of the replica finds that bit-identical to
    one product (a collective over ``mesh``). Returns each chunk parameter's origin by name: the
    parameter it was cut from and its first row.

    Every unit — the root included — is given ``reshard_after_forward=True`` explicitly: left to
    its default the root keeps its parameters unsharded after forward, expecting a backward
    (pytorch #131965, honoured since PR #154704), and an integer value OOMs in inference
    (pytorch #147179). Embeddings and head are their own units (torchtitan PR #182) so that the
    root, which is unsharded for the whole forward, holds only small tensors (final norm,
    position embeddings).

    Pre-forward all-gathers are synchronous and freed at once (``_set_unshard_async_op``): the
    default keeps the previous unit's whole all-gather buffer alive until the next one, to overlap
    copy-out with the next collective on a GPU stream — on a CPU that is one unit of memory more
    for nothing.
    """
    blocks = decoder_blocks(model)
    origins: dict[str, tuple[nn.Parameter, int]] = {}
    if mesh.device_type == "cpu" and blocks:
        largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
        cut = split_vocabulary(model, largest)
        origins = {n: cut[id(p)] for n, p in model.named_parameters() if id(p) in cut}
        head = model.get_output_embeddings()  # type: ignore[operator]
        if isinstance(head, ChunkedHead):
            head.by_chunks = _all_ranks_agree(head.products_by_chunk_are_exact(), mesh)
            logger.info(
                "output head cut into %d chunks, multiplied %s",
                len(head.parts),
                "chunk by chunk" if head.by_chunks else "as one weight (chunked is not exact here)",
            )
    for block in blocks:
        _shard_unit(block, mesh)
    for part in vocabulary_units(model):
        _shard_unit(part, mesh)
    for unit in embedding_units(model):
        _shard_unit(unit if len(unit) > 1 else unit[0], mesh)
    _shard_unit(model, mesh)
    root = cast(FSDPModule, model)
    if mesh.device_type == "cpu" and hasattr(root, "_set_unshard_async_op"):
        root._set_unshard_async_op(True)
    return origins


def _shard_unit(module: nn.Module | list[nn.Module], mesh: DeviceMesh) -> None:
    """``fully_shard`` one unit, whose parameters may mix dtypes.

    A model may keep some weights in float32 beside its bf16 ones (a NemotronH router's
    weight): FSDP all-gathers a unit's mixed dtypes as bytes, but refuses a unit whose
    *trainable* parameters do not share one dtype ("FSDP expects uniform original parameter
    dtype"). Nothing is trained, so the unit's parameters of another dtype than most of its
    elements are frozen; the others keep ``requires_grad`` as loaded, since torch's matmul
    rounds a non-contiguous 3-D input otherwise when the weight requires grad (see
    :mod:`rayeval.actors.parallel.vocab_chunks`), and lm-eval hf's weights require it.
    """
    modules = module if isinstance(module, list) else [module]
    params = [p for m in modules for p in _unit_parameters(m)]
    sizes: dict[torch.dtype, int] = {}
    for param in params:
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if len(sizes) > 1:
        main = max(sizes, key=lambda dtype: sizes[dtype])
        for param in params:
            if param.dtype != main:
                param.requires_grad_(False)
        others = ", ".join(sorted(str(dtype) for dtype in sizes if dtype != main))
        logger.info("an FSDP unit holds %s weights beside its %s ones: frozen", others, main)
    fully_shard(module, mesh=mesh, reshard_after_forward=True)


def _unit_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ``fully_shard(module)`` takes: those of no FSDP unit inside it."""
    found = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, FSDPModule):
            found += _unit_parameters(child)
    return found


def _all_ranks_agree(value: bool, mesh: DeviceMesh) -> bool:
    """True only if ``value`` is true on every rank of ``mesh`` (ranks may sit on other CPUs)."""
    flag = torch.tensor([int(value)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return bool(flag.item())


def release_unsharded(model: nn.Module) -> None:
    """After a forward or ``generate``: every FSDP unit back to its shard, per-step state cleared.

    Every unit already reshards after its own forward; this also covers a forward that stopped
    early, and clears the per-forward bookkeeping FSDP2 keeps for a backward that inference never
    runs (``post_forward_order`` grows by one entry per unit per forward otherwise; pytorch
    #149029 reports memory growing across ``no_grad`` forwards until ``reshard()``).
    """
    if not isinstance(model, FSDPModule):
        return
    if hasattr(model, "reset_iter_state"):  # torch >= 2.11: reshards and clears, from the root
        model.reset_iter_state()
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
