"""Which directories are training checkpoints, whether their save is complete, and how a sweep
names and orders them. No torch: the CLI and the service read this too.

A checkpoint directory holds its weights in one of two forms (:class:`CheckpointFormat`):

* **DCP** — a ``torch.distributed.checkpoint`` directory: shard files (``__0_0.distcp``, ...)
  and a ``.metadata`` file that DCP writes *last*, once every rank's shards are on disk
  (``FileSystemWriter`` writes it to a temporary name and renames it). accelerate's FSDP
  ``SHARDED_STATE_DICT`` saves put that directory one level down, as ``pytorch_model_fsdp_0/``
  (model 0; ``_1`` ... for further models); naming the parent is enough.
* **HF files** — safetensors (one ``model.safetensors`` or several named by
  ``model.safetensors.index.json``) or ``.bin`` files, as ``save_pretrained`` writes them.
* **A LoRA adapter** — ``adapter_config.json`` beside ``adapter_model.safetensors`` (or
  ``.bin``), as a PEFT trainer saves each checkpoint (``checkpoint-500/``). PEFT's
  ``save_pretrained`` writes the weights first and the config last, so weights without the
  config are a save still being written. A sweep over adapters keeps the base (``pretrained``)
  loaded and swaps only the adapter (:mod:`rayeval.service.engine.sweep`).

:func:`inspect_dir` says which, and whether the save is complete: a DCP directory without its
``.metadata`` is half-written (still being saved, or the save failed); a safetensors file is
complete when its size is what its own header promises; a ``.bin`` file when it is a whole zip
archive; an index when every file it names is complete. :func:`expand` turns ``--checkpoints``
(a list, globs) into directories, :func:`labels` gives each a unique name for its output files,
and :func:`step_of_dir` reads the training step: ``global_step`` of the ``trainer_state.json``
that Hugging Face's Trainer saves in each checkpoint, else the name's last number
(:func:`step_of`: ``step-1000``, ``checkpoint-500``).
"""

from __future__ import annotations

import glob
import json
import re
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rayeval.actors.errors import CheckpointError, ConfigError

#: The file DCP writes last, once a save is complete.
DCP_METADATA = ".metadata"
#: accelerate's FSDP sharded-state-dict folder for model N: ``pytorch_model_fsdp_N``.
ACCELERATE_DIR_PREFIX = "pytorch_model_fsdp_"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"
_BIN_INDEX = "pytorch_model.bin.index.json"
_BIN_SINGLE = "pytorch_model.bin"
#: What PEFT's ``save_pretrained`` writes: the weights, then (last) the config.
ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: What Hugging Face's Trainer saves in each checkpoint beside the weights.
TRAINER_STATE = "trainer_state.json"
_STEP = re.compile(r"(\d+)(?!.*\d)")


class CheckpointFormat(StrEnum):
    """How a checkpoint directory stores its weights."""

    DCP = "dcp"
    HF = "hf"
    ADAPTER = "adapter"


@dataclass(frozen=True)
class CheckpointDir:
    """A checkpoint directory as named, and where its weights are.

    Args:
        path: The directory as the user named it (or as a watch found it).
        weights: The directory holding the weight files (the DCP directory with ``.metadata``,
            which is ``path/pytorch_model_fsdp_0`` for accelerate's saves).
        format: DCP, HF files or a LoRA adapter.
        complete: Whether the save is complete.
        problem: Why it is not complete (empty when it is).
    """

    path: Path
    weights: Path
    format: CheckpointFormat
    complete: bool
    problem: str = ""


def inspect_dir(path: str | Path) -> CheckpointDir | None:
    """What checkpoint ``path`` holds and whether its save is complete; None if it holds none.

    Args:
        path: A directory.

    Returns:
        The checkpoint, complete or not, or None when ``path`` is not a directory or holds
        neither DCP files, HF weight files nor an adapter.
    """
    root = Path(path)
    if not root.is_dir():
        return None
    adapter = _adapter_problem(root)
    if adapter is not None:
        return CheckpointDir(root, root, CheckpointFormat.ADAPTER, not adapter, adapter)
    for candidate in [root, *sorted(root.glob(f"{ACCELERATE_DIR_PREFIX}*"))]:
        if (candidate / DCP_METADATA).is_file():
            return CheckpointDir(root, candidate, CheckpointFormat.DCP, True)
    for candidate in [root, *sorted(root.glob(f"{ACCELERATE_DIR_PREFIX}*"))]:
        if candidate.is_dir() and any(candidate.glob("*.distcp")):
            return CheckpointDir(
                root,
                candidate,
                CheckpointFormat.DCP,
                False,
                f"{candidate} has DCP shard files but no {DCP_METADATA} file: the save is "
                "incomplete (still being written, or it failed)",
            )
    problem = _hf_files_problem(root)
    if problem is None:
        return None
    return CheckpointDir(root, root, CheckpointFormat.HF, not problem, problem)


def _adapter_problem(root: Path) -> str | None:
    """Why the adapter saved in ``root`` is incomplete ("" if complete; None: it has none)."""
    weights = [root / name for name in _ADAPTER_WEIGHTS if (root / name).is_file()]
    if not (root / ADAPTER_CONFIG).is_file():
        if not weights:
            return None
        return (
            f"{weights[0]} has no {ADAPTER_CONFIG} beside it: the adapter's save is incomplete "
            "(PEFT writes the config last)"
        )
    if not weights:
        return (
            f"{root} has {ADAPTER_CONFIG} but no adapter_model.safetensors: the save is "
            "incomplete, or it is not a PEFT adapter folder"
        )
    return _file_problem(weights[0])


def _hf_files_problem(root: Path) -> str | None:
    """Why the HF weight files of ``root`` are incomplete ("" if complete; None: it has none)."""
    for index_name in (_SAFETENSORS_INDEX, _BIN_INDEX):
        index = root / index_name
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                return f"{index} is not a complete index ({type(exc).__name__}: {exc})"
            for name in files:
                why = _file_problem(root / name)
                if why:
                    return why
            return ""
    for single in (_SAFETENSORS_SINGLE, _BIN_SINGLE):
        if (root / single).is_file():
            return _file_problem(root / single)
    return None


def _file_problem(path: Path) -> str:
    """Why one weights file is incomplete ("" if it is complete)."""
    if not path.is_file():
        return f"{path} is missing (the save is still being written, or it failed)"
    if path.suffix == ".safetensors":
        size = path.stat().st_size
        try:
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            end = max(
                (info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"),
                default=0,
            )
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            return f"{path} has no complete safetensors header ({type(exc).__name__})"
        if size < 8 + header_len + end:
            return f"{path} holds {size} of {8 + header_len + end} bytes (still being written)"
        return ""
    if not zipfile.is_zipfile(path):
        return f"{path} is not a complete torch archive (still being written, or legacy format)"
    return ""


def checkpoint_or_error(path: str | Path) -> CheckpointDir:
    """The complete checkpoint at ``path``.

    Raises:
        CheckpointError: ``path`` is missing, holds no checkpoint, or its save is incomplete,
            naming which and what to do.
    """
    found = inspect_dir(path)
    if found is None:
        if not Path(path).exists():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist: check the path")
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint: expected a torch.distributed.checkpoint "
            f"directory (with a {DCP_METADATA} file), accelerate's {ACCELERATE_DIR_PREFIX}0/ "
            "folder, safetensors/.bin files as save_pretrained writes them, or a PEFT adapter "
            f"({ADAPTER_CONFIG} + adapter_model.safetensors)"
        )
    if not found.complete:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be used: {found.problem}. Wait for the save to "
            "finish, or name a complete checkpoint."
        )
    return found


def step_of(name: str) -> int | None:
    """The training step in a checkpoint's name: its last number (None without one).

    ``step-1000`` -> 1000, ``checkpoint-500`` -> 500, ``global_step20`` -> 20.
    """
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def step_of_dir(path: Path) -> int | None:
    """A checkpoint's training step: ``global_step`` of its ``trainer_state.json`` (Hugging Face's
    Trainer saves one in each checkpoint; for accelerate's folder, beside it), else the last
    number of its name (:func:`step_of`); None without either."""
    folder = Path(path)
    states = [folder / TRAINER_STATE]
    if folder.name.startswith(ACCELERATE_DIR_PREFIX):
        states.append(folder.parent / TRAINER_STATE)
    for state in states:
        try:
            step = json.loads(state.read_text()).get("global_step")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
    return step_of(label_of(folder))


def label_of(path: Path) -> str:
    """A checkpoint's own name: its directory, or for accelerate's folder its parent's."""
    resolved = Path(path)
    if resolved.name.startswith(ACCELERATE_DIR_PREFIX) and resolved.parent.name:
        return resolved.parent.name
    return resolved.name or str(resolved)


def by_step(paths: Sequence[Path]) -> list[Path]:
    """``paths`` sorted by training step (:func:`step_of_dir`; those without one last, by name)."""

    def key(path: Path) -> tuple[bool, int, str]:
        step = step_of_dir(path)
        return (step is None, step or 0, str(path))

    return sorted(paths, key=key)


def expand(spec: str | Sequence[str]) -> list[Path]:
    """The checkpoint directories ``--checkpoints`` names, in evaluation order.

    Args:
        spec: Comma-separated paths and globs (``run/step-*``), or a list of them. A glob's
            matches are sorted by step number; named paths keep their order. Each directory
            is named once.

    Raises:
        ConfigError: nothing named, or a glob matching no directory.
    """
    items = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    paths: list[Path] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if glob.has_magic(item):
            matches = [Path(p) for p in glob.glob(item) if Path(p).is_dir()]
            if not matches:
                raise ConfigError(f"--checkpoints {item!r} matches no directory: check the glob")
            paths += by_step(matches)
        else:
            paths.append(Path(item))
    unique = list(dict.fromkeys(paths))
    if not unique:
        raise ConfigError("--checkpoints names no checkpoint: give paths or a glob (run/step-*)")
    return unique


def labels(paths: Sequence[Path]) -> dict[Path, str]:
    """A unique, file-name-safe label per checkpoint: its own name (:func:`label_of`), or its
    path below the checkpoints' common parent where two share a name (``/`` -> ``__``)."""
    names = {path: label_of(path) for path in paths}
    if len(set(names.values())) == len(names):
        return {path: _safe(name) for path, name in names.items()}
    resolved = {path: path.resolve() for path in paths}
    common = Path(_common_parent(list(resolved.values())))
    return {path: _safe(str(full.relative_to(common))) for path, full in resolved.items()}


def _common_parent(paths: list[Path]) -> str:
    import os

    return os.path.commonpath([str(p.parent) for p in paths])


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", name.replace("/", "__")) or "checkpoint"


def candidates(root: str | Path) -> list[CheckpointDir]:
    """The checkpoints directly under a training run's directory, complete or not, by step.

    Raises:
        ConfigError: ``root`` is not a directory.
    """
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory: name the run's checkpoint folder")
    found = [inspect_dir(child) for child in by_step([c for c in base.iterdir() if c.is_dir()])]
    return [checkpoint for checkpoint in found if checkpoint is not None]
