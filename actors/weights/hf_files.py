"""Finding and reading a model's checkpoint on one rank: config, dtype, weight files, slices.

Every strategy's loader reads through here. A local directory or a hub snapshot holds
safetensors (one file or several, through ``model.safetensors.index.json``) or ``.bin`` files
(one or several, through ``pytorch_model.bin.index.json``); :func:`find_checkpoint` maps each
tensor name to its file, and :class:`SliceReader` hands out dim-0 slices (or any region) of a
tensor without reading the rest: a safetensors slice is read from the file into a new tensor, a
``.bin`` slice is a view of the memory-mapped file. Legacy (pre-zip) ``.bin`` files cannot be
memory-mapped (:class:`CannotStream`): the caller then loads the model whole. Training
checkpoints named by ``checkpoint=`` (DCP directories too) are read through
:mod:`rayeval.actors.weights.sources`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn

from rayeval.actors.batches import ModelSpec
from rayeval.actors.errors import ModelLoadError

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"
_BIN_INDEX = "pytorch_model.bin.index.json"
_BIN_SINGLE = "pytorch_model.bin"


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


def load_plain(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | None = None
) -> nn.Module:
    """The whole model by ``from_pretrained``: in host memory, or with ``device`` read straight
    onto it (lm-eval's ``device_map={"": device}``), never whole in host memory first."""
    kwargs = from_pretrained_kwargs(spec)
    if device is not None and "device_map" not in kwargs:
        kwargs["device_map"] = {"": str(device)}
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec.pretrained, dtype=dtype, **kwargs
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load {spec.pretrained!r}: {exc}") from exc


def match_key(aliases: Sequence[str], names: Collection[str], prefix: str) -> str | None:
    """The name among ``names`` of a parameter known by ``aliases`` (a tied weight has two),
    with or without the model's ``base_model_prefix``; None if it has none."""
    for name in aliases:
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1 :])
        if prefix:
            candidates.append(f"{prefix}.{name}")
        for candidate in candidates:
            if candidate in names:
                return candidate
    return None


def load_generation_config(model: Any, spec: ModelSpec) -> None:
    """Give a model built from its config the generation config ``from_pretrained`` would read
    beside it (``generation_config.json``), where there is one.

    Every way a rank builds a model without ``from_pretrained`` on ``spec.pretrained`` (FSDP's
    sharded loading, a training checkpoint under either strategy) calls this, and the driver's
    weightless shell reads the same file (:func:`read_generation_config`): ``generate`` reads
    its settings (repetition penalty, n-gram bans, EOS ids, ...), so lm-eval's HF backend
    applies them, and so must every strategy and every decision the driver takes.
    """
    config = read_generation_config(spec.pretrained, spec.revision or "main", spec.subfolder)
    if config is not None:
        model.generation_config = config


def read_generation_config(
    pretrained: str, revision: str = "main", subfolder: str = ""
) -> transformers.GenerationConfig | None:
    """``pretrained``'s ``generation_config.json`` as ``from_pretrained`` reads it, or None when
    there is none (the config derived from the model config then stays)."""
    try:
        return transformers.GenerationConfig.from_pretrained(
            pretrained, revision=revision, subfolder=subfolder
        )
    except OSError:
        return None


class CannotStream(Exception):
    """The checkpoint cannot be read slice by slice (a legacy, non-zip ``.bin`` file)."""


@dataclass(frozen=True)
class Checkpoint:
    """Where each tensor of a local checkpoint lives: safetensors or ``.bin`` files."""

    files: dict[str, Path]  # tensor name -> file
    safetensors: bool

    def key_for(self, aliases: list[str], model: nn.Module) -> str | None:
        """The checkpoint's name for a parameter known by ``aliases``, or None if it has none."""
        return match_key(aliases, self.files, getattr(model, "base_model_prefix", ""))

    @contextlib.contextmanager
    def reader(self) -> Iterator[SliceReader]:
        with contextlib.ExitStack() as stack:
            yield SliceReader(self, stack)


class SliceReader:
    """Opens each checkpoint file once and hands out dim-0 slices of its tensors.

    A safetensors slice is read from the file into a new tensor (the slice is the only copy); a
    ``.bin`` slice is a view of the memory-mapped file (no copy at all).
    """

    def __init__(self, checkpoint: Checkpoint, stack: contextlib.ExitStack) -> None:
        self._checkpoint = checkpoint
        self._stack = stack
        self._open: dict[Path, Any] = {}

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (all of a 0-d tensor when both are None)."""
        path = self._open_file(key)
        if self._checkpoint.safetensors:
            tensor_slice = self._open[path].get_slice(key)
            return tensor_slice[:] if start is None else tensor_slice[start:stop]
        tensor = self._open[path][key]
        return tensor if start is None else tensor[start:stop]  # a view of the mapped file

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole shape of tensor ``key``."""
        path = self._open_file(key)
        if self._checkpoint.safetensors:
            return tuple(self._open[path].get_slice(key).get_shape())
        return tuple(self._open[path][key].shape)

    def region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The part of tensor ``key`` of ``sizes`` starting at ``offsets`` (any dimensions)."""
        path = self._open_file(key)
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        if self._checkpoint.safetensors:
            tensor_slice = self._open[path].get_slice(key)
            return tensor_slice[index] if index else tensor_slice[:]
        return self._open[path][key][index]

    def _open_file(self, key: str) -> Path:
        path = self._checkpoint.files[key]
        if path not in self._open:
            self._open[path] = (
                self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                if self._checkpoint.safetensors
                else mmap_bin(path)
            )
        return path


def mmap_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as exc:  # e.g. "mmap can only be used with files saved with ..."
        raise CannotStream(f"{path.name} cannot be memory-mapped ({exc})") from exc


def find_checkpoint(spec: ModelSpec) -> Checkpoint | None:
    """Map every tensor name to its file (safetensors preferred), or None if there is no file.

    Raises:
        CannotStream: for a single ``.bin`` file in the legacy (pre-zip) format.
    """
    return find_checkpoint_in(_checkpoint_dir(spec))


def find_checkpoint_in(root: Path) -> Checkpoint | None:
    """:func:`find_checkpoint` for the weight files of a local directory.

    Raises:
        CannotStream: for a single ``.bin`` file in the legacy (pre-zip) format.
    """
    if (root / _SAFETENSORS_INDEX).is_file():
        return Checkpoint(_index_files(root, _SAFETENSORS_INDEX), safetensors=True)
    if (root / _SAFETENSORS_SINGLE).is_file():
        with safe_open(str(root / _SAFETENSORS_SINGLE), framework="pt", device="cpu") as handle:
            names = list(handle.keys())
        return Checkpoint(dict.fromkeys(names, root / _SAFETENSORS_SINGLE), safetensors=True)
    if (root / _BIN_INDEX).is_file():
        return Checkpoint(_index_files(root, _BIN_INDEX), safetensors=False)
    if (root / _BIN_SINGLE).is_file():
        names = list(mmap_bin(root / _BIN_SINGLE))
        return Checkpoint(dict.fromkeys(names, root / _BIN_SINGLE), safetensors=False)
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
