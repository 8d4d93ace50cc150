"""The flags of ``rayeval run`` and ``rayeval submit``, and the evaluation they describe.

lm-eval's own ``run`` parser supplies lm-eval's flags; rayeval's own (the layout, batching and
timeouts) are generated here from the fields of
:class:`rayeval.service.vocabulary.config.EvaluationConfig`. :func:`config_from_args` reads a parsed
command line into that config with lm-eval's precedence (flags over ``--config`` YAML over its
defaults).
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayeval.service.vocabulary.config import CodeExecution

#: Title of the argument group that holds rayeval's own flags in ``run`` and ``submit``.
GROUP_TITLE = "rayeval layout, batching and timeouts"
#: ``rayeval run``'s flags of the host and the console, not of the evaluation.
HOST_FLAGS = frozenset(
    {"address", "mlflow_tracking_uri", "verbose", "oversubscribe", "run_unsafe_code_unsandboxed"}
)
#: ``--device``'s help in ``run``, ``watch`` and ``submit`` (lm-eval's offers ``mps``).
DEVICE_HELP = (
    "what each rank holds: auto (GPUs where the cluster has some, else CPU slots; the default), "
    "cpu or cuda (cuda:N is read as cuda: Ray assigns the GPUs)"
)
BATCH_SIZE_HELP = (
    "an integer (rows per micro-batch, as lm-eval), or auto (the default, as over REST: "
    "micro-batches cut by a padded-token budget, --max_batch_tokens, of at most "
    "--max_batch_size rows)"
)


def add_config_flags(group: argparse._ArgumentGroup, queued: bool = True) -> None:
    """Add rayeval's own ``run`` flags, one per config field lm-eval has no flag for.

    Name, type, default and help all come from the field in
    :class:`rayeval.service.vocabulary.config.EvaluationConfig` (``RAYEVAL_FLAGS`` names the flag).

    Args:
        group: Where the flags go (``run``'s or ``submit``'s argument group).
        queued: Whether the evaluation waits in a server's queue (``submit``): else the
            scheduling flags (``--priority``, ``--preemptible``) are not shown, and refused
            naming ``rayeval submit`` when given.
    """
    from rayeval.service.vocabulary.config_fields import RAYEVAL_FLAGS, field_info

    for path, flag in RAYEVAL_FLAGS.items():
        info = field_info(path)
        default = info.get_default(call_default_factory=True)
        choices = None
        kind: Callable[[str], Any]
        if isinstance(info.annotation, type) and issubclass(info.annotation, enum.Enum):
            kind = str
            choices = [member.value for member in info.annotation]
            default = default.value
        elif isinstance(default, bool):
            kind = parse_bool
        elif _takes_object(info.annotation):
            kind = parse_key_values
        else:
            kind = float if path[0] == "timeouts" else int
        shown = (
            info.description
            if "default" in info.description
            else f"{info.description.rstrip('.')} (default {default})."
        )
        server_only = not queued and path[0] == "scheduling"
        group.add_argument(
            flag,
            dest=dest(path),
            type=kind,
            default=default,
            choices=choices,
            metavar=_metavar(kind, choices),
            help=argparse.SUPPRESS if server_only else shown,
            action=_QueueOnly if server_only else "store",
        )


class _QueueOnly(argparse.Action):
    """A scheduling flag given to a command without a queue: refused, naming ``submit``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        values = str(values).lower() if isinstance(values, bool) else values
        parser.error(
            f"{option} orders evaluations in a server's queue; {parser.prog} has no queue (it "
            f"runs at once on its own Ray): drop {option}, or send the evaluation to a server "
            f"with `rayeval submit ... {option} {values}`"
        )


def adapt_lm_eval_flags(parser: argparse.ArgumentParser) -> None:
    """lm-eval's ``run`` flags as rayeval reads them: ``--device`` (no ``mps``) and
    ``--batch_size`` (default ``auto``, as over REST) say so in their help."""
    actions = parser._option_string_actions
    actions["--device"].help = DEVICE_HELP
    actions["--device"].metavar = "{auto,cpu,cuda}"
    actions["--batch_size"].help = BATCH_SIZE_HELP


def add_ray_flags(parser: argparse._ActionsContainer) -> None:
    """``--address`` (also spelt ``--ray-address``, as ``serve`` spells it) and
    ``--oversubscribe``: where the ranks of ``run`` and ``watch`` run."""
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address, e.g. auto or ray://HOST:10001 (also --ray-address; default: "
        "$RAY_ADDRESS, else a Ray embedded in this process, sized to this machine)",
    )
    parser.add_argument(
        "--run_unsafe_code_unsandboxed",
        action="store_true",
        help="with --confirm_run_unsafe_code: run model-written code as lm-eval does, in this "
        "machine's processes with its network, files and environment, instead of in a "
        "bubblewrap sandbox (a warning says so). Without it, such code runs in the sandbox only",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="with an embedded Ray: start more CPU ranks (R x G x --cpus_per_rank) than this "
        "machine has cores (they share the cores: slower, the same results). Without it such a "
        "layout is refused before Ray starts. GPUs cannot be oversubscribed, and an existing "
        "cluster (--address) holds what its nodes declare",
    )


def _metavar(kind: Callable[[str], Any], choices: list[str] | None) -> str:
    if choices:
        return "{" + ",".join(choices) + "}"
    if kind is parse_bool:
        return "BOOL"
    if kind is parse_key_values:
        return "K=V,..."
    return "S" if kind is float else "N"


def parse_bool(text: str) -> bool:
    """A boolean flag's value: true/false (also 1/0, yes/no).

    Raises:
        argparse.ArgumentTypeError: for anything else (argparse names the flag).
    """
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_key_values(text: str) -> dict[str, Any]:
    """An object flag's value, as lm-eval reads ``--model_args``: ``key=value,key2=value2``.

    Raises:
        argparse.ArgumentTypeError: text that is not such pairs (argparse names the flag).
    """
    from rayeval.service.vocabulary.lm_eval_options import parse_args_string

    try:
        parsed: dict[str, Any] = parse_args_string(text) if text.strip() else {}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed


def _takes_object(annotation: Any) -> bool:
    """Whether a field's type is an object (a model, ``X | None`` of one, or a dict)."""
    import types
    import typing

    from pydantic import BaseModel

    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else ()
    return any(
        option is dict or (isinstance(option, type) and issubclass(option, BaseModel))
        for option in (*options, annotation)
    )


def dest(path: Sequence[str]) -> str:
    """The namespace attribute of a rayeval flag: its name (``num_replicas``, ...)."""
    from rayeval.service.vocabulary.config_fields import RAYEVAL_FLAGS

    return RAYEVAL_FLAGS[tuple(path)].removeprefix("--")


def config_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """The evaluation's config and the host options from ``rayeval run``'s flags.

    lm-eval's flags are read exactly as ``lm_eval run`` reads them (its precedence: flags over
    ``--config`` YAML over its defaults, then its own validation); rayeval's flags come from the
    config's fields. Errors name the flag.

    Args:
        args: ``rayeval run``'s (or ``submit``'s) parsed command line, with ``address``.

    Returns:
        ``(EvaluationConfig, HostOptions)``.

    Raises:
        ConfigError: naming each bad flag.
    """
    from pydantic import ValidationError

    from rayeval.actors.errors import ConfigError
    from rayeval.service.trackers import Trackers
    from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
    from rayeval.service.vocabulary.config_fields import RAYEVAL_FLAGS, cli_flag, describe_errors
    from rayeval.service.vocabulary.lm_eval_options import LM_EVAL_HOST_FIELDS

    ours = {path: getattr(args, dest(path)) for path in RAYEVAL_FLAGS}
    rayeval_only = {dest(path) for path in RAYEVAL_FLAGS} | HOST_FLAGS
    cfg, metadata = _lm_eval_config({k: v for k, v in vars(args).items() if k not in rayeval_only})
    data: dict[str, Any] = {
        name: getattr(cfg, name)
        for name in EvaluationConfig.model_fields
        if hasattr(cfg, name) and name not in ("metadata", "parallelism", "timeouts")
    }
    data["metadata"] = metadata
    for path, value in ours.items():
        target = data
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    mlflow_uri = getattr(args, "mlflow_tracking_uri", None)
    if mlflow_uri and data["tracking"] is None:  # naming a tracker here asks to be recorded in it
        data["tracking"] = {}
    try:
        config = EvaluationConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, cli_flag)) from None
    host = HostOptions(
        output_path=cfg.output_path,
        include_paths=tuple(_as_list(cfg.include_path)),
        address=args.address,
        lm_eval={name: getattr(cfg, name) for name in LM_EVAL_HOST_FIELDS},
        trackers=Trackers(mlflow_tracking_uri=mlflow_uri),
        code_execution=_code_execution(cfg.confirm_run_unsafe_code, args),
    )
    return config, host


def _code_execution(confirmed: bool, args: argparse.Namespace) -> CodeExecution:
    """``--confirm_run_unsafe_code`` runs model-written code in the sandbox; outside it only
    with the second flag, ``--run_unsafe_code_unsandboxed``."""
    from rayeval.actors.errors import ConfigError
    from rayeval.service.vocabulary.config import CodeExecution

    unsandboxed = getattr(args, "run_unsafe_code_unsandboxed", False)
    if unsandboxed and not confirmed:
        raise ConfigError(
            "--run_unsafe_code_unsandboxed needs --confirm_run_unsafe_code (it says where "
            "confirmed code runs)"
        )
    if not confirmed:
        return CodeExecution.OFF
    return CodeExecution.HOST if unsandboxed else CodeExecution.SANDBOX


def _lm_eval_config(given: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """lm-eval's ``EvaluatorConfig`` from its flags, with its own precedence (as
    ``EvaluatorConfig.from_cli`` applies it), and the ``--metadata`` as given."""
    from dataclasses import asdict

    from lm_eval.config.evaluate_config import EvaluatorConfig

    from rayeval.service.vocabulary.config import EvaluationConfig

    given["device"] = given.get("device") or "auto"  # lm-eval would default to cuda
    # The batch size defaults as in a REST body (lm-eval's default is 1); a --config YAML or the
    # flag sets another.
    default_batch = EvaluationConfig.model_fields["batch_size"].default
    values = asdict(EvaluatorConfig()) | {"batch_size": default_batch}
    if given.get("config"):
        values.update(EvaluatorConfig.load_yaml_config(given["config"]))
    values.update(
        {k: v for k, v in given.items() if (v or v == 0) and k not in ("command", "func")}
    )
    values.pop("config", None)
    metadata = dict(values["metadata"] or {})  # before lm-eval merges model_args into it
    return EvaluatorConfig(**values)._configure(), metadata


def _as_list(value: Any) -> list[str]:
    if not value:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
