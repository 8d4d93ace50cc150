"""Loading a Hugging Face causal LM on one rank: plain (G=1) or sharded with FSDP2 (G>1).

Sharded loading never materialises the whole model on a rank. The model is built on the meta
device; ``fully_shard`` makes every decoder block, the input embeddings and the output head their
own FSDP units (torchtitan's layout; tied embeddings and head are one unit, since they are one
tensor), then the root; every unit reshards after forward. Each rank then reads only its own
dim-0 slice of every tensor from the checkpoint: safetensors (one file or several, through
``model.safetensors.index.json``) are read slice by slice, and ``.bin`` files (one or several,
through ``pytorch_model.bin.index.json``) are memory-mapped and sliced the same way. Peak host
memory per rank is therefore about model/G plus one unit (on CPU ranks a large vocabulary
matrix is cut into units of a decoder block's size: :mod:`rayeval.actors.vocab_chunks`). Only
checkpoints whose tensor names do not match the model, or legacy (pre-zip) ``.bin`` files that
cannot be memory-mapped, fall back to a full load on every rank followed by sharding, with a
warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ModelLoadError
from rayeval.actors.vocab_chunks import (
    ChunkedEmbedding,
    ChunkedHead,
    split_vocabulary,
    vocabulary_units,
)

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"
_BIN_INDEX = "pytorch_model.bin.index.json"
_BIN_SINGLE = "pytorch_model.bin"


def load_model(spec: ModelSpec, device: torch.device, mesh: DeviceMesh | None) -> nn.Module:
    """Load the model for one rank, in eval mode, on ``device``.

    Args:
        spec: What to load.
        device: This rank's device.
        mesh: The replica's 1-D device mesh for FSDP2, or None for a plain (unsharded) replica.

    Returns:
        The model (an ``FSDPModule`` when ``mesh`` is given).

    Raises:
        ModelLoadError: if the checkpoint cannot be found or read.
    """
    config = load_config(spec)
    dtype = resolve_dtype(spec.dtype, config)
    model = (
        _load_plain(spec, dtype)
        if mesh is None
        else _load_sharded(spec, config, dtype, mesh, device)
    )
    if mesh is None:
        model.to(device)
    model.eval()
    return model


def load_config(spec: ModelSpec) -> transformers.PretrainedConfig:
    """The model's transformers config.

    Raises:
        ModelLoadError: it cannot be found or read.
    """
    try:
        return transformers.AutoConfig.from_pretrained(
            spec.pretrained,
            revision=spec.revision,
            subfolder=spec.subfolder,
            trust_remote_code=spec.trust_remote_code,
        )
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load the model config of {spec.pretrained!r}: {exc}. Pass an existing local "
            "path or a Hugging Face hub id in model_args pretrained=..."
        ) from exc


def resolve_dtype(name: str | None, config: transformers.PretrainedConfig) -> torch.dtype:
    """lm-eval's ``dtype`` model arg as a torch dtype (``auto``: the checkpoint's, else fp32)."""
    if name in (None, "auto"):
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, torch.dtype):
            return configured
        return getattr(torch, configured) if isinstance(configured, str) else torch.float32
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ModelLoadError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return value


def from_pretrained_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of ``spec`` other than the path and the dtype."""
    return {
        "revision": spec.revision,
        "subfolder": spec.subfolder,
        "trust_remote_code": spec.trust_remote_code,
        **spec.extra_kwargs,
    }


def _load_plain(spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec.pretrained, dtype=dtype, **from_pretrained_kwargs(spec)
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load {spec.pretrained!r}: {exc}") from exc


# ------------------------------------------------------------------------------ FSDP2 units
def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of any HF causal LM, innermost first.

    Uses the model's own ``_no_split_modules`` (Llama, GPT-2, GPT-NeoX, Qwen2, Mistral all declare
    their decoder layer there); falls back to the children of the longest ``nn.ModuleList``.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
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
    about a block's size, each its own unit (:mod:`rayeval.actors.vocab_chunks`): it is then never
    held twice while FSDP copies it out, the embedding never holds more than a chunk, and the
    head multiplies chunk by chunk where every rank of the replica finds that bit-identical to
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
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    for part in vocabulary_units(model):
        fully_shard(part, mesh=mesh, reshard_after_forward=True)
    for unit in embedding_units(model):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    root = cast(FSDPModule, model)
    if mesh.device_type == "cpu" and hasattr(root, "_set_unshard_async_op"):
        root._set_unshard_async_op(True)
    return origins


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


# -------------------------------------------------------------------------- sharded loading
def _load_sharded(
    spec: ModelSpec,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    device: torch.device,
) -> nn.Module:
    try:
        checkpoint = _find_checkpoint(spec)
    except _CannotStream as exc:
        return _full_load_then_shard(spec, dtype, mesh, device, str(exc))
    if checkpoint is None:
        return _full_load_then_shard(
            spec, dtype, mesh, device, "no safetensors or .bin checkpoint file found"
        )
    model = _meta_model(spec, config, dtype)
    keys = {name: checkpoint.key_for(aliases, model) for name, aliases in _aliases(model).items()}
    missing = sorted(name for name, key in keys.items() if key is None)
    if missing:
        return _full_load_then_shard(
            spec,
            dtype,
            mesh,
            device,
            f"checkpoint tensor names do not match {len(missing)} model parameters "
            f"(e.g. {missing[0]})",
        )
    # Parameters on meta, buffers real: non-persistent buffers (rotary inv_freq) are computed in
    # __init__ and are not in the checkpoint, so they must survive to_empty().
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    first_names = {id(param): name for name, param in model.named_parameters()}
    origins = shard_model(model, mesh)
    # A vocabulary chunk reads its rows of the tensor it was cut from.
    offsets: dict[str, int] = {}
    for name, (origin, start) in origins.items():
        keys[name] = keys[first_names[id(origin)]]
        offsets[name] = start
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        try:
            _read_local_shards(model, keys, checkpoint, mesh, offsets)
        except _CannotStream as exc:
            del model
            return _full_load_then_shard(spec, dtype, mesh, device, str(exc))
    return model


def _full_load_then_shard(
    spec: ModelSpec, dtype: torch.dtype, mesh: DeviceMesh, device: torch.device, why: str
) -> nn.Module:
    logger.warning(
        "%s for %s: every rank loads the whole model before sharding (peak memory = the whole "
        "model per rank). Save the checkpoint as safetensors to load only each rank's shard.",
        why,
        spec.pretrained,
    )
    model = _load_plain(spec, dtype)
    shard_model(model, mesh)
    model.to(device)
    return model


def _meta_model(
    spec: ModelSpec, config: transformers.PretrainedConfig, dtype: torch.dtype
) -> nn.Module:
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=spec.trust_remote_code
        )
    # init_empty_weights re-creates every registered parameter on meta, which unties a tied head
    # from the embeddings (lm_head.weight is no longer wte.weight): tie them again.
    model.tie_weights()
    return model


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each distinct parameter's first name, with every name it has (a tied weight has two)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {aliases[0]: aliases for aliases in names.values()}


class _CannotStream(Exception):
    """The checkpoint cannot be read slice by slice (a legacy, non-zip ``.bin`` file)."""


@dataclass(frozen=True)
class _Checkpoint:
    """Where each tensor of a local checkpoint lives: safetensors or ``.bin`` files."""

    files: dict[str, Path]  # tensor name -> file
    safetensors: bool

    def key_for(self, aliases: list[str], model: nn.Module) -> str | None:
        """The checkpoint's name for a parameter known by ``aliases``, or None if it has none."""
        prefix = getattr(model, "base_model_prefix", "")
        for name in aliases:
            candidates = [name]
            if prefix and name.startswith(prefix + "."):
                candidates.append(name[len(prefix) + 1 :])
            if prefix:
                candidates.append(f"{prefix}.{name}")
            for candidate in candidates:
                if candidate in self.files:
                    return candidate
        return None

    @contextlib.contextmanager
    def reader(self) -> Iterator[_SliceReader]:
        with contextlib.ExitStack() as stack:
            yield _SliceReader(self, stack)


class _SliceReader:
    """Opens each checkpoint file once and hands out dim-0 slices of its tensors.

    A safetensors slice is read from the file into a new tensor (the slice is the only copy); a
    ``.bin`` slice is a view of the memory-mapped file (no copy at all).
    """

    def __init__(self, checkpoint: _Checkpoint, stack: contextlib.ExitStack) -> None:
        self._checkpoint = checkpoint
        self._stack = stack
        self._open: dict[Path, Any] = {}

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (all of a 0-d tensor when both are None)."""
        path = self._checkpoint.files[key]
        if self._checkpoint.safetensors:
            if path not in self._open:
                self._open[path] = self._stack.enter_context(
                    safe_open(str(path), framework="pt", device="cpu")
                )
            tensor_slice = self._open[path].get_slice(key)
            return tensor_slice[:] if start is None else tensor_slice[start:stop]
        if path not in self._open:
            self._open[path] = _mmap_bin(path)
        tensor = self._open[path][key]
        return tensor if start is None else tensor[start:stop]  # a view of the mapped file


def _mmap_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as exc:  # e.g. "mmap can only be used with files saved with ..."
        raise _CannotStream(f"{path.name} cannot be memory-mapped ({exc})") from exc


def _read_local_shards(
    model: nn.Module,
    keys: dict[str, str | None],
    checkpoint: _Checkpoint,
    mesh: DeviceMesh,
    offsets: dict[str, int],
) -> None:
    """Copy each parameter's local rows from the checkpoint (``offsets``: first checkpoint row
    of a parameter that is a row chunk of a checkpoint tensor)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    with checkpoint.reader() as reader:
        for name, param in model.named_parameters():
            key = keys[name]
            assert key is not None
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(param, DTensor):
                if tuple(param.placements) != (Shard(0),):
                    raise ModelLoadError(f"unexpected FSDP placement {param.placements} for {name}")
                # FSDP2's dim-0 chunks: ceil(rows / world) each, the last ones shorter or empty.
                chunk = math.ceil(param.shape[0] / world) if param.dim() else 0
                start = min(rank * chunk, param.shape[0]) + offsets.get(name, 0)
                value = reader.rows(key, start, start + local.shape[0])
            else:
                value = reader.rows(key)
            if tuple(value.shape) != tuple(local.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {key} has shape {tuple(value.shape)} for this rank, the "
                    f"model expects {tuple(local.shape)}: the checkpoint does not match its config"
                )
            local.copy_(value)  # converts the dtype too; the slice is the only temporary
            del value


def _find_checkpoint(spec: ModelSpec) -> _Checkpoint | None:
    """Map every tensor name to its file (safetensors preferred), or None if there is no file.

    Raises:
        _CannotStream: for a single ``.bin`` file in the legacy (pre-zip) format.
    """
    root = _checkpoint_dir(spec)
    if (root / _SAFETENSORS_INDEX).is_file():
        return _Checkpoint(_index_files(root, _SAFETENSORS_INDEX), safetensors=True)
    if (root / _SAFETENSORS_SINGLE).is_file():
        with safe_open(str(root / _SAFETENSORS_SINGLE), framework="pt", device="cpu") as handle:
            names = list(handle.keys())
        return _Checkpoint(dict.fromkeys(names, root / _SAFETENSORS_SINGLE), safetensors=True)
    if (root / _BIN_INDEX).is_file():
        return _Checkpoint(_index_files(root, _BIN_INDEX), safetensors=False)
    if (root / _BIN_SINGLE).is_file():
        names = list(_mmap_bin(root / _BIN_SINGLE))
        return _Checkpoint(dict.fromkeys(names, root / _BIN_SINGLE), safetensors=False)
    return None


def _index_files(root: Path, index_name: str) -> dict[str, Path]:
    weight_map = json.loads((root / index_name).read_text())["weight_map"]
    return {name: root / file for name, file in weight_map.items()}


def _checkpoint_dir(spec: ModelSpec) -> Path:
    local = Path(spec.pretrained) / spec.subfolder
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    folder = f"{spec.subfolder.rstrip('/')}/" if spec.subfolder else ""
    try:
        snapshot = snapshot_download(
            spec.pretrained,
            revision=spec.revision,
            allow_patterns=[f"{folder}*.safetensors", f"{folder}*.json"],
        )
    except Exception as exc:
        raise ModelLoadError(
            f"cannot find {spec.pretrained!r} locally or on the Hugging Face hub ({exc}). "
            "Pass an existing local path, or a hub id reachable from every node."
        ) from exc
    return Path(snapshot) / spec.subfolder
