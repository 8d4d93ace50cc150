"""Fine-tuned weights over a base model, as lm-eval's hf backend takes them: a LoRA adapter
(``peft=``) or delta weights (``delta=``).

* **LoRA** (``peft=DIR``, a folder a PEFT trainer saved: ``adapter_config.json`` +
  ``adapter_model.safetensors``). Each rank applies it with PEFT's own
  ``PeftModel.from_pretrained``, unmerged, as lm-eval does, onto the model it has already
  loaded: whole (G = 1), FSDP2-sharded or tensor-parallel. PEFT wraps each target
  ``nn.Linear`` (or GPT-2's ``Conv1D``, with ``fan_in_fan_out``) in a LoRA layer whose
  ``base_layer`` is that same module object, so FSDP2 still gathers and frees the base weight
  at each forward; the adapter's own matrices (``r x (in +
  out)`` per layer: a fraction of a percent of the model) are whole on every FSDP rank. Under
  tensor parallelism a layer that keeps its output columns holds only its rows of ``lora_B``,
  and a layer whose input arrives split gathers it first
  (:func:`rayeval.actors.parallel.tp_exact.split_lora`; the matrices are written after PEFT
  applied the adapter, ``split=True``). Unmerged, because merging changes
  answers: PEFT keeps a bf16 model's adapter in float32 and adds ``B(A(x)) * scaling`` to the
  base layer's output, so ``W + scaling * B @ A`` rounded into bf16 weights gives other bits.
  Unmerged, every layout gives lm-eval's own bits in float32 and bf16. When the tokenizer's
  length differs from the base's vocabulary, lm-eval resizes the embeddings and head first, and
  so do the ranks (:mod:`rayeval.actors.weights.vocabulary`): a padded vocabulary is cut to its
  first rows; added tokens take the rows of the whole embeddings and head the adapter saved
  (PEFT's ``save_embedding_layers``), written into the rows each rank holds before PEFT runs.
* **Delta** (``delta=DIR``, a model folder of the same architecture): its weights are added to
  the base's, ``param += delta`` in the model's dtype, as lm-eval adds them; each rank reads
  only the regions it holds (:mod:`rayeval.actors.weights.sources`): whole, FSDP2 shards or
  tensor-parallel slices.

The driver checks both on its weightless copy of the model before any rank starts
(:func:`adapter_problems`, :func:`delta_problems`; added tokens without saved embeddings are
refused there, since lm-eval gives them random rows); the ranks apply them
(:func:`apply_adapter`, :func:`add_delta`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError, ModelLoadError, field

#: What a PEFT trainer saves beside the adapter's weights.
ADAPTER_CONFIG = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
#: LoRA options that put something other than plain low-rank matrices on ``nn.Linear`` layers.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
}
_MERGE_FIX = (
    "merge it into the model first (PEFT's merge_and_unload, then save_pretrained) and pass "
    "the merged folder as pretrained="
)


def read_adapter_config(path: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of the adapter folder ``path``.

    Raises:
        ConfigError: no such folder, or no adapter config in it.
    """
    folder = Path(path).expanduser()
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        what = "no such folder" if not folder.is_dir() else f"no {ADAPTER_CONFIG} in it"
        raise ConfigError(
            f"peft={path}: {what}. Name the folder a PEFT trainer saved the adapter in "
            f"({ADAPTER_CONFIG} + adapter_model.safetensors), e.g. RUN/checkpoint-500"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"peft={path}: {ADAPTER_CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"peft={path}: {ADAPTER_CONFIG} is not a JSON object")
    return config


def adapter_problems(
    path: str, shell: Any, tokens: int | None = None, *, whole: bool | None = None
) -> None:
    """Refuse an adapter the ranks cannot apply to the model ``shell`` (its weightless copy)
    with a tokenizer of ``tokens`` tokens (None: as many as the model's vocabulary): not a
    LoRA, a LoRA option other than low-rank matrices on linear layers, matrices whose layers or
    shapes the model does not have (another base), or a vocabulary resize that lm-eval's
    answers cannot be reproduced for (:func:`rayeval.actors.weights.vocabulary.resize_problems`).
    Besides LoRA matrices, the adapter may carry the whole embeddings and head (PEFT's
    ``save_embedding_layers``). Reads the config and the weight file's header only.

    ``whole``: True where each rank holds the whole model (shard size 1), where PEFT applies
    LoRA on parameters (``target_parameters``: a MoE's fused expert weights, a router's weight)
    as it does for lm-eval hf, PEFT itself then checking those matrices' shapes; False where the
    model is sharded (the refusal says shard size 1 takes it); None where neither applies (a
    sweep's ranks swap adapters in place).

    Raises:
        ConfigError: naming the field and what to do.
    """
    from rayeval.actors.weights.vocabulary import (
        config_rows,
        resize_problems,
        resized_rows,
        saved_matrices,
    )

    config = read_adapter_config(path)
    kind = str(config.get("peft_type", "?"))
    if kind.upper() != "LORA":
        raise ConfigError(
            f"peft={path}: a {kind} adapter; the ranks apply LoRA adapters only: {_MERGE_FIX}"
        )
    _refuse_options(path, config, whole)
    parameters = list(config.get("target_parameters") or []) if whole else []
    shapes = adapter_shapes(path)
    if tokens is None:
        tokens = config_rows(shell.config)
    if tokens is not None:
        resize_problems(path, shell, tokens, shapes)
    matrices = saved_matrices(shell, shapes)
    rows = resized_rows(shell.config, tokens) if tokens is not None else None
    head = shell.get_output_embeddings()
    modules = dict(shell.named_modules())
    for key, shape in shapes.items():
        if key in matrices:
            continue
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ConfigError(
                f"peft={path}: tensor {key} is not a LoRA matrix of a linear layer (LoRA on "
                f"embeddings or other layers is not applied on the ranks): {_MERGE_FIX}"
            )
        name = key[: -len(suffix)].removeprefix("base_model.model.")
        if _on_parameter(name, modules, parameters):
            continue
        module = modules.get(name)
        features = _features(module)
        if features is None:
            raise ConfigError(
                f"peft={path}: the adapter trains layer {name}, which pretrained's model "
                f"({type(shell).__name__}) has not: name the base model the adapter was "
                f"trained on in pretrained= (its adapter config says "
                f"{config.get('base_model_name_or_path')!r})"
            )
        in_features, out_features = features
        if suffix == ".lora_A.weight":
            wanted = (shape[0], in_features)
        else:  # a LoRA on the head of a resized vocabulary has its new row count
            out = rows if module is head and rows is not None else out_features
            wanted = (out, shape[1])
        if tuple(shape) != wanted:
            raise ConfigError(
                f"peft={path}: tensor {key} has shape {tuple(shape)}, but layer {name} of "
                f"pretrained's model is {in_features} -> {out_features}: the "
                "adapter was trained on another base; name that one in pretrained= (its "
                f"adapter config says {config.get('base_model_name_or_path')!r})"
            )


def _refuse_options(path: str, config: dict[str, Any], whole: bool | None) -> None:
    """Refuse a LoRA option the ranks do not apply (``target_parameters`` only when sharded)."""
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option) and not (option == "target_parameters" and whole):
            unsharded = (
                f", or evaluate it unsharded ({field('parallelism', 'shard_size', value=1)})"
                if option == "target_parameters" and whole is False
                else ""
            )
            raise ConfigError(
                f"peft={path}: a LoRA adapter with {what}, which the sharded ranks do not "
                f"apply: {_MERGE_FIX}{unsharded}"
            )


def _on_parameter(name: str, modules: dict[str, Any], parameters: list[str]) -> bool:
    """Whether LoRA matrices named ``name`` adapt a parameter of ``parameters``
    (``target_parameters``): PEFT names them by the parameter's module, one ``.base_layer``
    more for each other parameter of that module it adapts."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    module = modules.get(name)
    if module is None or not parameters:
        return False
    own = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
    return any(full == t or full.endswith("." + t) for full in own for t in parameters)


def _features(module: Any) -> tuple[int, int] | None:
    """The input and output features of a layer LoRA adapts as a linear layer: ``nn.Linear``,
    or transformers' ``Conv1D`` (GPT-2's projections: a linear layer whose weight is stored
    transposed, ``in x out``, which PEFT adapts with ``fan_in_fan_out``); None for any other
    module."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        in_features, out_features = module.weight.shape
        return int(in_features), int(out_features)
    return None


def adapter_file(path: str) -> Path:
    """The adapter's weight file in the folder ``path``.

    Raises:
        ConfigError: the folder has no adapter weights.
    """
    folder = Path(path).expanduser()
    found = next((folder / name for name in _WEIGHT_FILES if (folder / name).is_file()), None)
    if found is None:
        raise ConfigError(
            f"peft={path}: no {' or '.join(_WEIGHT_FILES)} beside {ADAPTER_CONFIG}: name the "
            "folder the adapter's weights were saved in"
        )
    return found


def adapter_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor of the adapter's weight file and its shape (a safetensors header, or the
    ``.bin`` file loaded on the CPU: adapters are small).

    Raises:
        ConfigError: the folder has no adapter weights.
    """
    found = adapter_file(path)
    if found.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(found), framework="pt") as reader:
            return {k: tuple(reader.get_slice(k).get_shape()) for k in reader.keys()}  # noqa: SIM118
    import torch

    state = torch.load(found, map_location="cpu", weights_only=True)
    return {k: tuple(v.shape) for k, v in state.items()}


def apply_adapter(model: Any, path: str, revision: str | None, *, split: bool = False) -> None:
    """Apply the LoRA adapter at ``path`` to this rank's ``model`` (whole or FSDP2-sharded), in
    place and unmerged, with PEFT's own ``PeftModel.from_pretrained`` as lm-eval applies it.
    The embeddings and head the adapter saved, if any, first overwrite the rows this rank holds
    (:func:`rayeval.actors.weights.vocabulary.fill_saved_matrices`): PEFT loads them by name,
    which a rank holding them in vocabulary chunks does not have (it ignores them there; where
    the names match it writes the same values again).

    ``split``: the model is tensor-parallel, where PEFT builds each LoRA B with the rows of its
    layer's local weight; PEFT then leaves the saved B matrices (whose shapes differ) unloaded,
    for the caller to shape the layers and write them
    (:func:`rayeval.actors.parallel.tp_exact.split_lora`, :func:`load_adapter_weights`).

    Raises:
        ModelLoadError: PEFT cannot apply it.
    """
    from peft import PeftModel

    from rayeval.actors.weights.vocabulary import fill_saved_matrices

    fill_saved_matrices(model, path, adapter_file(path), adapter_shapes(path))
    try:
        wrapped = PeftModel.from_pretrained(
            model, path, revision=revision, ignore_mismatched_sizes=split
        )
    except Exception as exc:  # PEFT raises many kinds; each is a load failure here
        raise ModelLoadError(f"peft={path}: PEFT could not apply the adapter: {exc}") from exc
    model.eval()  # the injected LoRA layers too (their dropout is off)
    if wrapped.base_model.model is not model:  # the rank computes with ``model`` itself
        raise ModelLoadError(f"peft={path}: PEFT did not apply the adapter in place")


def delta_problems(path: str, shell: Any, pretrained: str) -> None:
    """Refuse delta weights that cannot be added to the model ``shell``: a tensor missing or of
    another shape. Reads file headers only.

    Raises:
        ConfigError: naming the field and what to do.
    """
    from rayeval.actors.weights.sources import open_source, problems, slots

    try:
        source = open_source(path)
    except (ConfigError, ModelLoadError) as exc:
        raise ConfigError(
            f"delta={path}: name a model folder of pretrained's architecture, as "
            f"save_pretrained writes it ({exc})"
        ) from None
    _, found = problems(slots(shell), source.shapes(), getattr(shell, "base_model_prefix", ""))
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(
            f"delta={path}: does not fit the model of pretrained={pretrained}: {found[0]}{more}."
            " Name delta weights of this model's architecture"
        )


def add_delta(model: Any, path: str, pretrained: str) -> int:
    """Add the delta weights at ``path`` to every parameter this rank holds (in place, in the
    parameter's dtype, as lm-eval's ``param.data += delta``), one tensor region at a time.

    Returns:
        Bytes read.

    Raises:
        ModelLoadError: a tensor is missing or has another shape, or cannot be read.
    """
    import torch

    from rayeval.actors.weights.dcp import Region
    from rayeval.actors.weights.sources import open_source, problems, refusal, slots

    source = open_source(path)
    wanted = slots(model)
    keys, found = problems(wanted, source.shapes(), getattr(model, "base_model_prefix", ""))
    if found:
        raise ModelLoadError(refusal(source.where, found, pretrained))
    read = 0
    with torch.no_grad():
        for slot in wanted:
            delta = torch.empty_like(slot.local)
            source.read([Region(keys[slot.name], delta, slot.offsets)])
            slot.local.add_(delta)
            read += delta.numel() * delta.element_size()
            del delta
    return read


#: ``adapter_config.json`` keys that may differ between two checkpoints of one LoRA run.
_RUN_BOOKKEEPING = frozenset(
    {"base_model_name_or_path", "revision", "peft_version", "inference_mode"}
)


def swap_problems(loaded: str, path: str, shell: Any, tokens: int | None = None) -> None:
    """Refuse swapping the LoRA at ``path`` in place of the one at ``loaded``: it must be
    applicable (:func:`adapter_problems`, ``tokens``: the tokenizer's length) and another
    checkpoint of the same run: the same config (rank, alpha, targets, ...) and the same
    matrices and shapes (saved embeddings and head included).

    Raises:
        ConfigError: naming what differs and what to do.
    """
    adapter_problems(path, shell, tokens)
    before, after = read_adapter_config(loaded), read_adapter_config(path)
    differ = sorted(
        key
        for key in before.keys() | after.keys()
        if key not in _RUN_BOOKKEEPING and _same(before.get(key)) != _same(after.get(key))
    )
    if not differ and adapter_shapes(loaded) != adapter_shapes(path):
        differ = ["its matrices or their shapes"]
    if differ:
        raise ConfigError(
            f"peft={path}: differs from the loaded adapter {loaded} in {', '.join(differ)}: only "
            "checkpoints of one LoRA run swap in place; evaluate this adapter on its own"
        )


def _same(value: Any) -> Any:
    """A config value as compared: PEFT saves sets (``target_modules``) as lists in any order."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return sorted(value)
    return value


def load_adapter_weights(model: Any, path: str) -> int:
    """Overwrite the LoRA matrices applied to ``model`` (:func:`apply_adapter`) with those saved
    at ``path``, another checkpoint of the same run (:func:`swap_problems`), in place and in
    the dtype PEFT gave them (a ``lora_B`` a tensor-parallel rank holds rows of, its
    ``rayeval_rows``, gets those rows); and the embeddings and head it saved, if any, in the
    rows this rank holds. Returns the bytes written.

    Raises:
        ModelLoadError: a matrix is missing, extra, or of another shape.
    """
    import torch
    from peft.utils import load_peft_weights

    from rayeval.actors.weights.vocabulary import fill_saved_matrices, saved_matrices

    saved = load_peft_weights(path, device="cpu")
    for key in saved_matrices(model, list(saved)):
        del saved[key]
    params = {
        name: param
        for name, param in model.named_parameters()
        if ".lora_A." in name or ".lora_B." in name
    }
    modules = dict(model.named_modules())
    written = 0
    with torch.no_grad():
        for key, value in saved.items():
            name = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
            # a tensor-parallel rank holds its rows of B (tp_exact.split_lora): cut the same
            rows = getattr(modules.get(name.removesuffix(".weight")), "rayeval_rows", None)
            if rows is not None:
                value = value[rows]
            param = params.pop(name, None)
            if param is None or tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"peft={path}: tensor {key} matches no loaded LoRA matrix")
            param.copy_(value)
            written += param.numel() * param.element_size()
    if params:
        raise ModelLoadError(f"peft={path}: no tensor for the loaded matrix {next(iter(params))}")
    return written + fill_saved_matrices(model, path, adapter_file(path), adapter_shapes(path))
