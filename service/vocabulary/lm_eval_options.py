"""lm-eval's options as rayeval reads them: model-arg tables, host-only options, parsing.

rayeval runs lm-eval's Hugging Face backend with lm-eval's own option names. What lm-eval takes
that rayeval does instead (``parallelize``, ``device_map``, ...), what only shapes the driver's
tokeniser, which model args are booleans (read strictly), and which ``lm_eval run`` options are
the host's rather than the evaluation's are listed here, with lm-eval's ``key=value`` string
form parsed the way lm-eval parses it. No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rayeval.actors.errors import ConfigError, field

_SHARD_SIZE = field("parallelism", "shard_size")

#: Names lm-eval gives its Hugging Face backend; rayeval runs exactly that backend.
HF_MODEL_NAMES = frozenset({"hf", "hf-auto", "huggingface"})

#: lm-eval HF model args that rayeval replaces or does not support, and what to do instead.
UNSUPPORTED_MODEL_ARGS = {
    "parallelize": f"rayeval shards the model itself: use {_SHARD_SIZE} instead",
    "device_map": f"rayeval places the model itself: use {_SHARD_SIZE} instead",
    "max_memory_per_gpu": f"rayeval places the model itself: use {_SHARD_SIZE} instead",
    "max_cpu_memory": f"rayeval places the model itself: use {_SHARD_SIZE} instead",
    "offload_folder": f"CPU offload is not supported: use a larger {_SHARD_SIZE}",
    "tp_plan": f"rayeval applies the model's tensor-parallel plan itself: use {_SHARD_SIZE} "
    f"with {field('parallelism', 'shard_strategy', value='tp')} (or auto)",
    "autogptq": "GPTQ checkpoints are not supported: run lm_eval directly for quantized models",
    "gptqmodel": "GPTQ checkpoints are not supported: run lm_eval directly for quantized models",
    "gguf_file": "GGUF checkpoints are not supported: use a safetensors checkpoint",
}

#: lm-eval HF model args that only shape tokenisation (the driver's HFLM reads them).
ENCODER_MODEL_ARGS = frozenset(
    {
        "tokenizer",
        "use_fast_tokenizer",
        "add_bos_token",
        "prefix_token_id",
        "max_length",
        "truncation",
        "think_end_token",
        "enable_thinking",
        "chat_template_args",
    }
)

#: lm-eval HF model args that are booleans: read strictly (a string "no" is not true).
BOOLEAN_MODEL_ARGS = frozenset(
    {
        "trust_remote_code",
        "use_fast_tokenizer",
        "add_bos_token",
        "truncation",
        "logits_cache",
        "enable_thinking",
    }
)

#: lm-eval ``run`` options that are the host's, not the evaluation's, and why a body can't set
#: them. (The layout keys are here because a flat ``num_replicas`` is a common mistake.)
HOST_ONLY_OPTIONS = {
    "include_path": "task directories come only from the server's --include-path; ask the "
    "server operator to add yours",
    "output_path": "the server keeps results: read them from GET /evaluations/{id}/results",
    "use_cache": "model-output caches are server files: not settable by a request",
    "cache_requests": "request caches are server files: not settable by a request",
    "trust_remote_code": "running code from model or dataset repositories is the server "
    "operator's decision: not settable by a request",
    "confirm_run_unsafe_code": "executing model-generated code is the server operator's "
    "decision: not settable by a request",
    "wandb_args": "logging integrations run on the server: not settable by a request",
    "wandb_config_args": "logging integrations run on the server: not settable by a request",
    "hf_hub_log_args": "logging integrations run on the server: not settable by a request",
    "trackio_args": "logging integrations run on the server: not settable by a request",
    "check_integrity": "task integrity tests run on the server: not settable by a request",
    "write_out": "prompt printing goes to the server's log: not settable by a request",
    "show_config": "task configs are in the results: read them from GET /evaluations/{id}/results",
    "verbosity": "the server's log level is the operator's: not settable by a request",
    "config": "send the options themselves in the body",
    "num_replicas": 'put it under "parallelism": {"num_replicas": R, "shard_size": G}',
    "shard_size": 'put it under "parallelism": {"num_replicas": R, "shard_size": G}',
    "cpus_per_rank": 'put it under "parallelism": {"cpus_per_rank": N}',
    "shard_strategy": 'put it under "parallelism": {"shard_strategy": "auto"}',
    "placement": 'put it under "parallelism": {"placement": "spread"}',
    "shm_collectives": 'put it under "parallelism": {"shm_collectives": false}',
    "address": "the server's Ray cluster is fixed by its --ray-address",
    "placement_timeout": 'put it under "timeouts": {"placement_s": ...}',
    "load_timeout": 'put it under "timeouts": {"load_s": ...}',
    "step_timeout": 'put it under "timeouts": {"step_s": ...}',
    "collective_timeout": 'put it under "timeouts": {"collective_s": ...}',
    "control_timeout": 'put it under "timeouts": {"control_s": ...}',
    "reuse_timeout": 'put it under "timeouts": {"reuse_s": ...}',
    "priority": 'put it under "scheduling": {"priority": N}',
    "preemptible": 'put it under "scheduling": {"preemptible": true}',
}

#: What the dtype model args accept: lm-eval's ``auto`` and the torch floating dtypes a model
#: loads in (lm-eval reads any other string with ``getattr(torch, ...)`` and fails at load).
MODEL_DTYPES = frozenset({"auto", "float32", "float", "float16", "half", "bfloat16", "float64"})
#: The dtype model args and whether null means "unset" for them (lm-eval's own defaults).
DTYPE_MODEL_ARGS = {"dtype": False, "softmax_dtype": True, "mixed_precision_dtype": True}


#: Fields of lm-eval's ``EvaluatorConfig`` that :class:`HostOptions` carries, not the config.
LM_EVAL_HOST_FIELDS = frozenset(
    {
        "use_cache",
        "cache_requests",
        "check_integrity",
        "write_out",
        "show_config",
        "verbosity",
        "wandb_args",
        "wandb_config_args",
        "hf_hub_log_args",
        "trackio_args",
        "trust_remote_code",
        "confirm_run_unsafe_code",
    }
)


def strict_booleans(model_args: Mapping[str, Any]) -> dict[str, bool]:
    """The boolean model args as booleans; ``"true"``/``"false"`` strings are read, anything else
    is an error (lm-eval would take any non-empty string, ``"no"`` included, as true)."""
    parsed: dict[str, bool] = {}
    for key in BOOLEAN_MODEL_ARGS & model_args.keys():
        value = model_args[key]
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"{key}: {value!r} is not a boolean: use true or false")
        parsed[key] = value
    return parsed


def parse_args_string(value: Any) -> Any:
    """lm-eval's ``key=value,key2=value2`` form as a dict (other values unchanged)."""
    if isinstance(value, str):
        from lm_eval.utils import simple_parse_args_string

        try:
            return simple_parse_args_string(value)
        except (ValueError, IndexError):
            raise ValueError(
                f"cannot parse {value!r}: use key=value pairs separated by commas"
            ) from None
    return value


def looks_local(value: str) -> bool:
    """A model named by a path, not a hub id (``org/name``): absolute, home- or dot-relative,
    more than one ``/``, or a separator a hub id never has."""
    separators = {os.sep, os.altsep} - {None, "/"}
    return (
        value.startswith(("/", "~", "./", "../"))
        or value in (".", "..")
        or value.count("/") > 1
        or any(sep in value for sep in separators if sep)
    )


def checked_model_args(value: dict[str, Any]) -> dict[str, Any]:
    """Model args with their booleans read strictly; a missing ``pretrained`` or an argument
    rayeval replaces is an error naming what to do instead.

    Raises:
        ValueError: naming every problem.
    """
    if not value.get("pretrained") or not isinstance(value["pretrained"], str):
        raise ValueError('needs pretrained: e.g. {"pretrained": "org/model-name"}')
    value = {**value, **strict_booleans(value)}
    unsupported = [f"{key}: {why}" for key, why in UNSUPPORTED_MODEL_ARGS.items() if value.get(key)]
    if value.get("backend", "default") not in ("default", "causal"):
        unsupported.append("backend: only causal (decoder-only) models are supported")
    if value.get("peft") and value.get("delta"):
        unsupported.append(
            "peft with delta: a LoRA adapter and delta weights cannot be applied together "
            "(lm-eval refuses them together too): give one of them"
        )
    for key in ("peft", "delta"):
        if value.get(key) and value.get("checkpoint"):
            unsupported.append(
                f"{key} with checkpoint: {key}= applies over pretrained's own weights: drop "
                "checkpoint=, or name the checkpoint's model folder in pretrained="
            )
    problems = ["unsupported — " + "; ".join(unsupported)] if unsupported else []
    problems += dtype_problems(value)
    if problems:
        raise ValueError("; ".join(problems))
    return value


def dtype_problems(model_args: Mapping[str, Any]) -> list[str]:
    """The dtype model args that name no dtype a model loads in, each with the accepted names."""
    problems = []
    for key, may_be_null in DTYPE_MODEL_ARGS.items():
        if key not in model_args or (model_args[key] is None and may_be_null):
            continue
        given = model_args[key]
        if not isinstance(given, str) or given not in MODEL_DTYPES:
            problems.append(
                f"model_args.{key}: {given!r} is not a dtype: use one of "
                f"{', '.join(sorted(MODEL_DTYPES))}"
                + ("" if key == "dtype" else f", or leave {key} out")
            )
    return problems


def parsed_batch_size(value: int | str) -> int | str:
    """lm-eval's ``batch_size``: an integer >= 1 (also as text), ``"auto"`` or ``"auto:N"``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) >= 1:
        return int(value)
    if isinstance(value, str) and value.startswith("auto"):
        rest = value.removeprefix("auto")
        if not rest or (rest.startswith(":") and rest[1:].isdigit() and int(rest[1:]) >= 1):
            return value
    raise ValueError(f'{value!r} is not a batch size: use an integer >= 1, "auto" or "auto:N"')


def lm_eval_evaluator_config(
    config: Any,
    output_path: str | None,
    include_paths: Sequence[str],
    host_options: Mapping[str, Any],
) -> Any:
    """lm-eval's ``EvaluatorConfig`` for an evaluation (``EvaluationConfig``) on a host,
    validated by lm-eval itself.

    Raises:
        ConfigError: lm-eval rejected a combination of options (the message says which).
    """
    from lm_eval.config.evaluate_config import EvaluatorConfig

    cfg = EvaluatorConfig(
        **dict(host_options),
        model=config.model,
        model_args=dict(config.model_args),
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        batch_size=config.batch_size,  # type: ignore[arg-type]  # lm-eval takes "auto" too
        max_batch_size=config.max_batch_size,
        device=config.device,
        limit=config.limit,
        samples={k: list(v) for k, v in config.samples.items()} if config.samples else None,
        log_samples=config.log_samples,
        predict_only=config.predict_only,
        output_path=output_path,
        system_instruction=config.system_instruction,
        apply_chat_template=config.apply_chat_template,
        fewshot_as_multiturn=config.fewshot_as_multiturn,
        include_path=list(include_paths) or None,  # type: ignore[arg-type]  # lists work
        gen_kwargs=dict(config.gen_kwargs),
        seed=list(config.seed) if isinstance(config.seed, tuple) else config.seed,
        metadata=dict(config.metadata),
    )
    try:
        return cfg._configure()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{exc} (fix this option of the evaluation)") from None
