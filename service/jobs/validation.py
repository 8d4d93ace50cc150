"""The server's checks of a submitted evaluation, before it is queued.

An :class:`rayeval.service.vocabulary.config.EvaluationConfig` is already well-formed; what is
checked here is what only the server can judge, so that what is accepted with 202 can run:

- its policy (:class:`ServerPolicy`): no code from a request's model repository unless the
  operator allows it; model args and generation settings from an allowlist; local models and
  tokenizers (and training checkpoints, ``model_args.checkpoint``, LoRA adapters,
  ``model_args.peft``, and delta weights, ``model_args.delta``) only under the operator's model
  roots, with one answer for a path that is missing and one that is forbidden (no file oracle),
  and so are a sweep's checkpoints (``sweep``: its globs expanded here, under the roots only);
  tracking only where the server has a tracker;
- task names (never paths) that its catalog knows, in ``tasks`` and in ``samples``;
- options lm-eval accepts together, and a layout the cluster can ever hold;
- a named shard strategy that can work: what it refuses of the model, read from a local
  model's ``config.json`` (for ``tp``: heads that G divides), and a node that can hold a replica's
  G ranks where the strategy needs one. Whether transformers has a tensor-parallel plan for the
  architecture needs its config classes (and torch), so that last check is the engine's, before
  any rank starts;
- ``apply_chat_template`` only for a local tokenizer that has a chat template.

Every problem is collected into one message. No torch here.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayeval.actors.errors import ConfigError, LayoutError, field
from rayeval.actors.layout import ShardStrategy
from rayeval.actors.parallel.strategies import refusal, strategy
from rayeval.actors.profiles import ModelShape
from rayeval.actors.weights.checkpoint_dirs import by_step
from rayeval.service.jobs.tasks import CODE_EVAL, OTHER_CODE, TaskCatalog, other_code_refusal
from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
from rayeval.service.vocabulary.errors import ServiceNotReadyError
from rayeval.service.vocabulary.lm_eval_options import ENCODER_MODEL_ARGS, looks_local

#: lm-eval HF model args a request may set (others reach ``from_pretrained`` and could load
#: files or code: the operator's business).
REQUEST_MODEL_ARGS = ENCODER_MODEL_ARGS | {
    "pretrained",
    "revision",
    "subfolder",
    "dtype",
    "logits_cache",
    "softmax_dtype",
    "mixed_precision_dtype",
    "backend",
    "trust_remote_code",
    "checkpoint",
    "peft",
    "delta",
}

#: Most checkpoints one sweep may name (after its globs are expanded).
MAX_SWEEP_CHECKPOINTS = 10_000

#: Generation settings a request may set, each with a check of its value.
_NUMBER = (int, float)
REQUEST_GEN_KWARGS: dict[str, Any] = {
    "until": lambda v: (
        isinstance(v, str)
        or (isinstance(v, list) and len(v) <= 64 and all(isinstance(x, str) for x in v))
    ),
    "max_gen_toks": lambda v: _is_int(v) and 1 <= v <= 1_000_000,
    "max_length": lambda v: _is_int(v) and 1 <= v <= 10_000_000,
    "do_sample": lambda v: isinstance(v, bool),
    "temperature": lambda v: _is_number(v) and 0 <= v <= 100,
    "top_p": lambda v: _is_number(v) and 0 <= v <= 1,
    "top_k": lambda v: _is_int(v) and 0 <= v <= 1_000_000,
    "min_p": lambda v: _is_number(v) and 0 <= v <= 1,
    "typical_p": lambda v: _is_number(v) and 0 <= v <= 1,
    "repetition_penalty": lambda v: _is_number(v) and 0 < v <= 100,
    "no_repeat_ngram_size": lambda v: _is_int(v) and 0 <= v <= 1_000,
    "num_beams": lambda v: _is_int(v) and 1 <= v <= 64,
    "length_penalty": lambda v: _is_number(v) and -100 <= v <= 100,
}


@dataclass(frozen=True)
class ServerPolicy:
    """What the operator lets a request do.

    Args:
        model_roots: Directories under which local models and tokenizers may be named.
        allow_hub_models: Whether hub ids (``org/name``) may be named.
        allow_remote_code: Whether ``trust_remote_code`` may be set.
        allow_code_execution: Whether tasks that run model-written code to score it
            (``unsafe_code`` in their resolved config: ``humaneval*``, ``mbpp*``) are accepted;
            their candidates then run in rayeval's bubblewrap sandbox, and only there.
        trackers: The experiment trackers the server records evaluations in (``mlflow``,
            ``wandb``); an evaluation asking to be tracked needs one.
    """

    model_roots: tuple[str, ...] = ()
    allow_hub_models: bool = True
    allow_remote_code: bool = False
    allow_code_execution: bool = False
    trackers: tuple[str, ...] = ()


def check_submission(
    config: EvaluationConfig,
    catalog: TaskCatalog,
    cluster_total: Mapping[str, float],
    task_index_wait_s: float,
    policy: ServerPolicy = ServerPolicy(),
    node_totals: Sequence[Mapping[str, float]] = (),
) -> EvaluationConfig:
    """Refuse an evaluation that could not run here, naming every problem at once.

    Args:
        config: The evaluation, its device resolved against the cluster.
        catalog: The task names evaluations may use.
        cluster_total: Ray's ``cluster_resources()``.
        task_index_wait_s: How long to wait for lm-eval's task index if a name is not local.
        policy: What the operator allows.
        node_totals: Each live node's total resources (for ``shard_strategy tp``: a node must
            hold a whole replica); empty: not checked.

    Returns:
        The evaluation as it is queued: a sweep's checkpoint globs expanded (:func:`expand_sweep`).

    Raises:
        ConfigError: bad model, tasks or options.
        LayoutError: the layout can never fit the cluster (requested vs available), when it
            is the only problem.
        ServiceNotReadyError: the task index is not ready yet and nothing else is wrong.
    """
    config, problems = expand_sweep(config, policy)
    problems += policy_problems(config, policy) + task_problems(config)
    problems += tracking_problems(config, policy)
    if not problems:  # a model path is read only once the policy allows it (no file oracle)
        problems += strategy_problems(config, node_totals) + chat_template_problems(config)
    try:
        config.evaluator_config(
            HostOptions(output_path="unused", include_paths=catalog.include_paths)
        )
    except ConfigError as exc:
        problems.append(exc.marked_message)
    if not task_problems(config):
        try:
            catalog.check(config.tasks, wait_s=task_index_wait_s)
            if config.samples:
                catalog.check(tuple(config.samples), wait_s=task_index_wait_s, field="samples")
            problems += code_problems(catalog.code_tasks(config.tasks, task_index_wait_s), policy)
        except ConfigError as exc:
            problems.append(exc.marked_message)
        except ServiceNotReadyError:
            if not problems:
                raise
    try:
        config.layout().check_fits(cluster_total)
    except LayoutError as exc:
        if not problems:
            raise
        problems.append(exc.marked_message)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def strategy_problems(
    config: EvaluationConfig, node_totals: Sequence[Mapping[str, float]] = ()
) -> list[str]:
    """Why the named ``shard_strategy`` cannot work for this evaluation (``auto`` always can: it
    falls back to FSDP). What needs transformers' config classes is the engine's to check."""
    parallelism = config.parallelism
    if parallelism.shard_strategy is ShardStrategy.AUTO or parallelism.shard_size == 1:
        return []
    chosen = strategy(parallelism.shard_strategy)
    problems = []
    args = config.model_args
    model_dir = Path(str(args["pretrained"])).expanduser() / str(args.get("subfolder") or "")
    config_file = model_dir / "config.json"
    if config_file.is_file():
        try:
            shape = ModelShape(json.loads(config_file.read_text()))
        except (OSError, ValueError):
            shape = None  # the engine reads it again and names the problem
        obstacles = chosen.model_obstacles(shape, parallelism.shard_size) if shape else []
        if obstacles:
            problems.append(refusal(chosen.name, obstacles))
    bundle = config.layout().bundle()
    holds = [
        min(int(node.get(key, 0.0) // amount) for key, amount in bundle.items())
        for node in node_totals
    ]
    if chosen.one_node and holds and max(holds) < parallelism.shard_size:
        problems.append(
            f"shard_strategy {chosen.name} needs a replica's {parallelism.shard_size} ranks on one "
            f"node, and no node of the cluster holds more than {max(holds)}: lower "
            f"{field('parallelism', 'shard_size')} or use "
            f"{field('parallelism', 'shard_strategy', value='auto')} (FSDP across nodes)"
        )
    return problems


#: Where a tokenizer keeps its chat template, besides ``tokenizer_config.json``'s key.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def chat_template_problems(config: EvaluationConfig) -> list[str]:
    """``apply_chat_template`` for a local tokenizer without a chat template (a hub tokenizer is
    not read here: lm-eval decides when it runs)."""
    if not config.apply_chat_template:
        return []
    args = config.model_args
    tokenizer = args.get("tokenizer")
    source = Path(str(tokenizer if isinstance(tokenizer, str) else args["pretrained"])).expanduser()
    if tokenizer is None:
        source = source / str(args.get("subfolder") or "")
    settings = source / "tokenizer_config.json"
    if not settings.is_file():
        return []
    try:
        has_template = bool(json.loads(settings.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return []  # lm-eval reads it again and names the problem
    if has_template or any((source / name).exists() for name in CHAT_TEMPLATE_FILES):
        return []
    return [
        f"apply_chat_template: the tokenizer at {str(source)!r} has no chat template: leave "
        "apply_chat_template false for a base model, or name a tokenizer that has one in "
        "model_args.tokenizer"
    ]


def tracking_problems(config: EvaluationConfig, policy: ServerPolicy) -> list[str]:
    """An evaluation that asks to be tracked needs a server that has a tracker (a sweep: MLflow,
    one run per checkpoint)."""
    if config.tracking is None:
        return []
    if config.sweep is not None and policy.trackers and "mlflow" not in policy.trackers:
        return [
            "tracking: a checkpoint sweep is recorded in MLflow (one run per checkpoint) and "
            'this server has no MLflow tracker: drop "tracking" and read the sweep at '
            "/evaluations/{id}/sweep, or ask its operator for --mlflow-tracking-uri"
        ]
    if policy.trackers:
        return []
    return [
        "tracking: this server records evaluations in no experiment tracker; drop "
        '"tracking", or ask its operator to start it with --mlflow-tracking-uri or '
        "--wandb-project"
    ]


def task_problems(config: EvaluationConfig) -> list[str]:
    """Task files come only from the server's include paths: a request names tasks, not files."""
    paths = [n for n in config.tasks if "/" in n or "\\" in n or n.endswith((".yaml", ".yml"))]
    if not paths:
        return []
    return [
        f"tasks: {paths} look like paths: give task names; task files come only from the "
        "server's --include-path"
    ]


def code_problems(code_tasks: Mapping[str, str], policy: ServerPolicy) -> list[str]:
    """Tasks that run model-written code: refused unless the operator allows code execution,
    and always where lm-eval runs the code outside ``code_eval`` (no sandbox here for that).

    Args:
        code_tasks: The requested names that run code, each with how
            (:meth:`rayeval.service.jobs.tasks.TaskCatalog.code_tasks`).
        policy: What the operator allows.
    """
    problems = []
    other = sorted(name for name, kind in code_tasks.items() if kind == OTHER_CODE)
    sandboxed = sorted(name for name, kind in code_tasks.items() if kind == CODE_EVAL)
    if other:
        problems.append(f"{other_code_refusal(other)}: not accepted on this server")
    if sandboxed and not policy.allow_code_execution:
        problems.append(
            f"tasks: {sandboxed} run model-written code to score it (unsafe_code in their "
            "config); this server does not run it: its operator can allow it with "
            "--allow-code-execution (RAYEVAL_ALLOW_CODE_EXECUTION=1), which runs every "
            "candidate in a bubblewrap sandbox"
        )
    return problems


def policy_problems(config: EvaluationConfig, policy: ServerPolicy) -> list[str]:
    """What the server's policy refuses in the model args and generation settings."""
    problems = []
    args = config.model_args
    for key in sorted(set(args) - REQUEST_MODEL_ARGS):
        problems.append(
            f"model_args.{key}: not settable by a request on this server (allowed: "
            f"{', '.join(sorted(REQUEST_MODEL_ARGS))})"
        )
    if args.get("trust_remote_code") and not policy.allow_remote_code:
        problems.append(
            "model_args.trust_remote_code: this server does not run code from model "
            "repositories; its operator can allow it with --allow-remote-code"
        )
    for key in ("pretrained", "tokenizer", "delta"):
        value = args.get(key)
        if isinstance(value, str):
            problems += _model_source_problems(f"model_args.{key}", value, args, policy)
    if "checkpoint" in args:
        problems += _checkpoint_problems(args["checkpoint"], policy)
    if "peft" in args:
        problems += _adapter_problems(args["peft"], policy)
    subfolder = args.get("subfolder", "")
    if not isinstance(subfolder, str) or os.path.isabs(subfolder) or ".." in Path(subfolder).parts:
        problems.append("model_args.subfolder: a relative folder inside the model, without '..'")
    for key, value in config.gen_kwargs.items():
        check = REQUEST_GEN_KWARGS.get(key)
        if check is None:
            problems.append(
                f"gen_kwargs.{key}: not a generation setting this server accepts (accepted: "
                f"{', '.join(sorted(REQUEST_GEN_KWARGS))})"
            )
        elif not check(value):
            problems.append(f"gen_kwargs.{key}: {value!r} is not a valid value")
    return problems


def _model_source_problems(
    where: str, value: str, args: Mapping[str, Any], policy: ServerPolicy
) -> list[str]:
    """A model or tokenizer named by a request: a hub id, or a model under a model root.

    A missing path and a path outside the roots get the same answer, so a request cannot probe
    the server's files.
    """
    if not looks_local(value) and not Path(value).exists():
        if policy.allow_hub_models:
            return []
        return [f"{where}: this server takes no hub ids: name a model under its model roots"]
    roots = [Path(root) for root in policy.model_roots]
    if roots:
        found = Path(value).expanduser().resolve()
        subfolder = args.get("subfolder") if where.endswith("pretrained") else None
        inside = any(found == root or root in found.parents for root in roots)
        model_dir = found / subfolder if isinstance(subfolder, str) and subfolder else found
        if inside and ((model_dir / "config.json").is_file() or "tokenizer" in where):
            return []
    return [
        f"{where}: {value!r} is not a model under this server's model roots "
        f"({', '.join(policy.model_roots) or 'none configured'}): name a model there or a hub "
        "id; the server operator adds roots with --model-root"
    ]


def _checkpoint_problems(
    value: Any, policy: ServerPolicy, where: str = "model_args.checkpoint"
) -> list[str]:
    """A training checkpoint named by a request: a directory under a model root (a missing one
    and one outside the roots get the same answer; whether it is a usable checkpoint is checked
    when the evaluation starts, before any rank computes)."""
    return _folder_problems(value, policy, where, "a checkpoint directory")


def _adapter_problems(value: Any, policy: ServerPolicy) -> list[str]:
    """A LoRA adapter named by a request: a folder under a model root, as ``pretrained`` is
    (whether it is an adapter of this model is checked when the evaluation starts, before any
    rank starts)."""
    return _folder_problems(value, policy, "model_args.peft", "an adapter folder")


def _folder_problems(value: Any, policy: ServerPolicy, where: str, what: str) -> list[str]:
    """``value`` at ``where`` must be ``what`` under a model root (a missing one and one
    outside the roots get the same answer)."""
    if isinstance(value, str) and value and _directory_under_roots(Path(value), policy):
        return []
    return [
        f"{where}: {value!r} is not {what} under this server's model roots "
        f"({', '.join(policy.model_roots) or 'none configured'}): save it under one, or the "
        "server operator adds its folder with --model-root"
    ]


def _directory_under_roots(path: Path, policy: ServerPolicy) -> bool:
    found = path.expanduser().resolve()
    roots = [Path(root).expanduser().resolve() for root in policy.model_roots]
    return found.is_dir() and any(found == root or root in found.parents for root in roots)


def expand_sweep(
    config: EvaluationConfig, policy: ServerPolicy
) -> tuple[EvaluationConfig, list[str]]:
    """A sweep's checkpoints as the server runs them, and what its policy refuses of them.

    Each glob of ``sweep.checkpoints`` becomes the directories under the model roots it
    matches, by step (a glob matching none there gets the same answer as a path outside them);
    every named directory and a watched one must be under a model root.

    Returns:
        The config with the checkpoints expanded (unchanged if it is not a sweep), and the
        problems.
    """
    spec = config.sweep
    if spec is None:
        return config, []
    problems = []
    if "checkpoint" in config.model_args:
        problems.append(
            "model_args.checkpoint: a sweep names its checkpoints in sweep.checkpoints or "
            "sweep.watch: drop model_args.checkpoint"
        )
    if config.model_args.get("peft"):
        problems.append(
            "model_args.peft: a sweep over adapter checkpoints names them in sweep.checkpoints "
            "or sweep.watch, with model_args.pretrained their base: drop model_args.peft"
        )
    if config.model_args.get("delta"):
        problems.append(
            "model_args.delta: a sweep's checkpoints replace pretrained's weights (or are "
            "adapters, which lm-eval does not combine with delta): drop model_args.delta"
        )
    if spec.watch is not None:
        return config, problems + _checkpoint_problems(spec.watch, policy, "sweep.watch")
    expanded: list[str] = []
    for item in spec.checkpoints or ():
        if glob.has_magic(item):
            found = [Path(p) for p in glob.glob(item)]
            matches = by_step([p for p in found if _directory_under_roots(p, policy)])
            if not matches:
                problems += _checkpoint_problems(item, policy, "sweep.checkpoints")
            expanded += [str(p.resolve()) for p in matches]
        else:
            problems += _checkpoint_problems(item, policy, "sweep.checkpoints")
            expanded.append(str(Path(item).expanduser().resolve()))
    checkpoints = tuple(dict.fromkeys(expanded))
    if len(checkpoints) > MAX_SWEEP_CHECKPOINTS:
        problems.append(
            f"sweep.checkpoints: {len(checkpoints)} checkpoints, at most "
            f"{MAX_SWEEP_CHECKPOINTS}: split the sweep"
        )
    return config.model_copy(
        update={"sweep": spec.model_copy(update={"checkpoints": checkpoints})}
    ), problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and math.isfinite(value)
