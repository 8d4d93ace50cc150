"""One evaluation's configuration, declared once for every entry point.

:class:`EvaluationConfig` is what an evaluation *is*: the model, the tasks, lm-eval's options
(same names and meanings as ``lm_eval run``), the layout and the timeouts, each with its default
and its validation. It is built from a REST body (it *is* the body of ``POST /evaluations``), from
``rayeval run``'s flags (:func:`rayeval.api.cli` derives rayeval's own flags from its fields) or
from Python, stored as JSON by the job service, and handed unchanged to the runner and the engine.

Where an evaluation runs and writes — output path, task directories, the Ray address, lm-eval's
trackers and caches — is not part of it: :class:`HostOptions` carries that, set by whoever runs
the evaluation (the CLI's user, or the server operator), never by a REST client.

Errors name the field in each door's words (:mod:`rayeval.service.vocabulary.config_fields`);
lm-eval's tables and host-only options are :mod:`rayeval.service.vocabulary.lm_eval_options`'. No
torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from rayeval.actors.batches import DEFAULT_GENERATE_ROWS, DEFAULT_LOGITS_BUDGET_MIB
from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import (
    DeviceKind,
    ParallelLayout,
    PlacementPolicy,
    ShardStrategy,
    Timeouts,
)
from rayeval.service.trackers import TRACKING_HELP, Trackers, Tracking
from rayeval.service.vocabulary.config_groups import Frozen as _Frozen
from rayeval.service.vocabulary.config_groups import Scheduling, SweepSpec, TimeoutSettings
from rayeval.service.vocabulary.lm_eval_options import (
    HF_MODEL_NAMES,
    HOST_ONLY_OPTIONS,
    LM_EVAL_HOST_FIELDS,
    checked_model_args,
    lm_eval_evaluator_config,
    parse_args_string,
    parsed_batch_size,
)

#: lm-eval's default seeds for random, numpy, torch and few-shot sampling (its ``DEFAULT_SEED``).
DEFAULT_SEED: tuple[int, int, int, int] = (0, 1234, 1234, 1234)
#: lm-eval's default number of bootstrap iterations for metric standard errors.
DEFAULT_BOOTSTRAP_ITERS = 100000
#: Padded tokens per micro-batch with ``batch_size=auto`` when ``max_batch_tokens`` is unset.
DEFAULT_MAX_BATCH_TOKENS = 8192
#: The same for scoring micro-batches on CPU ranks (faster per token: see service.engine.lm).
DEFAULT_CPU_SCORE_BATCH_TOKENS = 2048
#: Rows per micro-batch with ``batch_size=auto`` when ``max_batch_size`` is unset (the ranks set
#: aside a generation group's logits by the same number).
DEFAULT_MAX_BATCH_ROWS = DEFAULT_GENERATE_ROWS

_EXAMPLE: dict[str, Any] = {
    "model": "hf",
    "model_args": {"pretrained": "/models/llama-3-8b", "dtype": "bfloat16"},
    "tasks": ["hellaswag", "arc_easy"],
    "num_fewshot": 0,
    "batch_size": "auto",
    "log_samples": True,
    "parallelism": {"num_replicas": 2, "shard_size": 2},
}


#: A seed numpy accepts; a document index.
_Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
_DocIndex = Annotated[int, Field(ge=0, le=2**31 - 1)]


class Parallelism(_Frozen):
    """The layout: R data-parallel replicas x G ranks per replica (one GPU or CPU slot each)."""

    num_replicas: int = Field(
        default=1, ge=1, le=4096, description="R: data-parallel replicas of the model."
    )
    shard_size: int = Field(
        default=1, ge=1, le=4096, description="G: ranks per replica; the model sharded if > 1."
    )
    shard_strategy: ShardStrategy = Field(
        default=ShardStrategy.AUTO,
        description="How a replica of G > 1 ranks shards the model: fsdp (FSDP2: any model, "
        "bit-identical for every G, slow to generate), tp (tensor parallelism: fast generation; "
        "needs a TP plan, an architecture it was checked on (docs/conformance.md), heads divisible "
        "by G, a replica on one node), or auto (tp where it can work, else fsdp).",
    )
    cpus_per_rank: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="CPU slots per rank (on CPU ranks also torch's threads).",
    )
    shm_collectives: bool = Field(
        default=True,
        description="Let the ranks of a replica on one CPU node sum their activations through "
        "shared memory (/dev/shm) instead of the process group's sockets: tensor parallelism "
        "only, bit-identical to gloo at 2 ranks, much lower latency per decode step; false "
        "keeps every collective on gloo.",
    )
    placement: PlacementPolicy = Field(
        default=PlacementPolicy.AUTO,
        description="How ranks are placed on nodes: auto (replicas spread over nodes, each "
        "sharded replica on one node where it fits), pack (as few nodes as possible) or spread "
        "(as many nodes as possible: with G > 1 a replica's ranks on different nodes, slower; "
        "to rehearse or test a replica that spans nodes).",
    )


class EngineConfig(_Frozen):
    """What the engine needs of an evaluation: the model, its layout, batching and timeouts.

    :class:`EvaluationConfig` adds the tasks and lm-eval's options; the Python API
    (``RayEvalLM(pretrained=..., num_replicas=...)``) builds this part alone with
    :func:`~rayeval.service.vocabulary.config_fields.config_from_keywords`.
    """

    model_args: dict[str, Any] = Field(
        ...,
        description='lm-eval model args, as an object or as "pretrained=...,dtype=..."; '
        "pretrained (hub id or a path on the server) is required.",
    )
    batch_size: int | str = Field(
        default="auto", description='An integer, "auto" or "auto:N" (rows per micro-batch).'
    )
    max_batch_size: int | None = Field(default=None, ge=1, le=1_000_000)
    max_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**40,
        description=f"Padded tokens per micro-batch with batch_size auto (default "
        f"{DEFAULT_MAX_BATCH_TOKENS}; {DEFAULT_CPU_SCORE_BATCH_TOKENS} for loglikelihood "
        "micro-batches on CPU ranks).",
    )
    share_prefixes: bool = Field(
        default=True,
        description="Feed the model the tokens that loglikelihood requests share (a question's "
        "context before its choices, common few-shot examples) once per micro-batch, with "
        "results equal to scoring each request alone; false: one row per distinct input, as "
        "lm-eval. Applies in float32 only: in bf16 and fp16 attention rounds by the width of "
        "the row it runs over, so a packed row would not give lm-eval hf's bits, and every input "
        "gets a row of its own. Models that cannot take a custom attention mask always use one "
        "row per input.",
    )
    continuous_batching: bool = Field(
        default=True,
        description="Generate with continuous batching: a row leaves as soon as it stops and the "
        "next request takes its slot, with lm-eval hf's greedy answers. In float32 only: in "
        "bf16 and fp16 attention over the slots' cache rounds otherwise than over lm-eval hf's "
        "batch, so those generate in static batches, as lm-eval. Settings it cannot "
        "reproduce exactly (beams, repetition penalties, an explicit max_length, thinking "
        "tokens, architectures not checked) fall back to static batches, as lm-eval.",
    )
    kv_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**40,
        description="KV-cache positions one rank holds while generating with continuous "
        "batching (a request needs its context plus its max_gen_toks, and the rows share one "
        "cache left-padded to the longest row: rows x the most any needs is held); default: "
        "max_batch_tokens if set, else what the slots' rows need, bounded only where a rank's "
        "free memory holds less when the generation is planned.",
    )
    logits_budget_mib: int = Field(
        default=DEFAULT_LOGITS_BUDGET_MIB,
        ge=1,
        le=2**20,
        description="MiB of logits and log-probabilities a rank holds at once while scoring: a "
        "micro-batch's scored positions run through the output head in chunks of as many (at "
        "least 16), with the results of one pass (at a 152k vocabulary, 256 MiB is 208 "
        "positions).",
    )
    tokenizer_workers: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Ray actors (one CPU each, spread over the nodes) that tokenise a request "
        "type of more than one part (over 65,536 loglikelihood or 16,384 generate_until "
        "requests) while the driver plans and dispatches, with the tokens the driver would "
        "make; default: half the CPUs free in the cluster (other evaluations keep the rest), "
        "at most 16; 0: the driver alone.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="What a rank holds; auto: GPUs when the cluster has any."
    )
    seed: _Seed | tuple[_Seed | None, ...] = Field(
        default=DEFAULT_SEED, description="One seed, or seeds for random, numpy, torch, few-shot."
    )
    parallelism: Parallelism = Parallelism()
    timeouts: TimeoutSettings = TimeoutSettings()
    scheduling: Scheduling = Scheduling()

    @property
    def pretrained(self) -> str:
        """The model's hub id or path."""
        return str(self.model_args["pretrained"])

    @property
    def checkpoint(self) -> str | None:
        """The training checkpoint whose weights the model loads (None: ``pretrained``'s own).
        Users give it as lm-eval's model args are given (``checkpoint=DIR``), so it travels in
        them; this is where the engine reads it."""
        value = self.model_args.get("checkpoint")
        return str(value) if value else None

    def with_checkpoint(self, checkpoint: str | None) -> Self:
        """This config evaluating ``checkpoint`` (None: ``pretrained``'s own weights)."""
        args = {k: v for k, v in self.model_args.items() if k != "checkpoint"}
        if checkpoint is not None:
            args["checkpoint"] = checkpoint
        return self.model_copy(update={"model_args": args})

    @property
    def seeds(self) -> tuple[int | None, ...]:
        """One seed per generator (random, numpy, torch, few-shot), as lm-eval expands them."""
        if isinstance(self.seed, int):
            return (self.seed,) * len(DEFAULT_SEED)
        return self.seed

    def layout(self, device: DeviceKind | None = None) -> ParallelLayout:
        """The layout this evaluation reserves.

        Args:
            device: What the ranks hold; default this config's device, which must then be
                resolved (not ``auto``).
        """
        return ParallelLayout(
            self.parallelism.num_replicas,
            self.parallelism.shard_size,
            device=device or DeviceKind(self.device),
            cpus_per_rank=self.parallelism.cpus_per_rank,
            placement=self.parallelism.placement,
        )

    @field_validator("model_args", mode="before")
    @classmethod
    def _parse_model_args(cls, value: Any) -> Any:
        return parse_args_string(value)

    @field_validator("model_args")
    @classmethod
    def _model_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return checked_model_args(value)

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, value: int | str) -> int | str:
        return parsed_batch_size(value)

    @field_validator("device", mode="before")
    @classmethod
    def _device_kind(cls, value: Any) -> Any:
        # lm-eval's --device takes "cuda:0"; a rank's device index is Ray's business.
        return value.split(":")[0] if isinstance(value, str) else value

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("timeouts", mode="before")
    @classmethod
    def _rank_timeouts(cls, value: Any) -> Any:
        return asdict(value) if isinstance(value, Timeouts) else value


_GROUPS: dict[str, type[BaseModel]] = {
    "parallelism": Parallelism,
    "timeouts": TimeoutSettings,
    "scheduling": Scheduling,
}


class EvaluationConfig(EngineConfig):
    """An evaluation: lm-eval's options (same names and meanings) plus the layout and timeouts."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        json_schema_extra={"examples": [_EXAMPLE]},
    )

    model: str = Field(default="hf", description='lm-eval model name; only "hf" is supported.')
    tasks: tuple[str, ...] = Field(
        ..., description="Task, group or tag names (glob patterns allowed), or 'a,b'."
    )
    num_fewshot: int | None = Field(default=None, ge=0, le=10_000)
    limit: float | None = Field(
        default=None,
        gt=0,
        le=1e9,
        allow_inf_nan=False,
        description="Docs per task (< 1: a fraction).",
    )
    samples: dict[str, tuple[_DocIndex, ...]] | None = Field(
        default=None, description="Per task, the doc indices to evaluate (instead of limit)."
    )
    log_samples: bool = False
    predict_only: bool = False
    gen_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='Generation overrides, object or "k=v,k2=v2".'
    )
    apply_chat_template: bool | str = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool | None = None
    bootstrap_iters: int = Field(
        default=DEFAULT_BOOTSTRAP_ITERS,
        ge=0,
        le=10_000_000,
        description="Bootstrap iterations for metric stderrs (0 skips them; 1 gives none).",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    tracking: Tracking | None = Field(default=None, description=TRACKING_HELP)
    sweep: SweepSpec | None = Field(default=None, description=SweepSpec.__doc__)

    # ------------------------------------------------------------------ validation
    @model_validator(mode="before")
    @classmethod
    def _refuse_host_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refused = [f"{key}: {why}" for key, why in HOST_ONLY_OPTIONS.items() if key in data]
            if refused:
                raise ValueError("; ".join(refused))
        return data

    @field_validator("model")
    @classmethod
    def _hf_only(cls, value: str) -> str:
        if value not in HF_MODEL_NAMES:
            raise ValueError(
                f"{value!r} is not supported: rayeval runs lm-eval's Hugging Face backend, "
                'use "hf"'
            )
        return value

    @field_validator("gen_kwargs", mode="before")
    @classmethod
    def _parse_gen_kwargs(cls, value: Any) -> Any:
        return parse_args_string(value)

    @field_validator("bootstrap_iters")
    @classmethod
    def _stderr_needs_two(cls, value: int) -> int:
        if value == 1:
            # lm-eval's sample standard deviation divides by iterations - 1.
            raise ValueError(
                "1 iteration cannot give a standard error (lm-eval divides by iterations - 1): "
                "use 0 to skip stderrs, or 2 or more (lm-eval's default is 100000)"
            )
        return value

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, value: Any) -> Any:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list | tuple):
            items = [t for item in items for t in str(item).split(",")]
            return tuple(dict.fromkeys(t.strip() for t in items if t.strip()))
        return value

    @field_validator("tasks")
    @classmethod
    def _some_task(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError('name at least one task, e.g. ["hellaswag"]')
        return value

    # ------------------------------------------------------------------ conversions
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (what the store keeps); :meth:`from_json` reads it back."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EvaluationConfig:
        """Rebuild a config from :meth:`to_json` output (rayeval 0.1's flat layout fields too)."""
        values = dict(data)
        flat = {k: values.pop(k) for k in Parallelism.model_fields if k in values}
        if flat:
            values["parallelism"] = {**values.get("parallelism", {}), **flat}
        return cls.model_validate(values)

    def with_device(self, device: DeviceKind) -> EvaluationConfig:
        """This config with ``device`` pinned (done once, at submission, against the cluster)."""
        return self.model_copy(update={"device": device.value})

    def evaluator_config(self, host: HostOptions) -> Any:
        """lm-eval's ``EvaluatorConfig`` for this evaluation on ``host``, validated by lm-eval.

        Returns:
            A configured ``lm_eval.config.evaluate_config.EvaluatorConfig``.

        Raises:
            ConfigError: lm-eval rejected a combination of options (message says which).
        """
        return lm_eval_evaluator_config(
            self,
            output_path=host.output_path,
            include_paths=host.include_paths,
            host_options=host.lm_eval,
        )


class CodeExecution(StrEnum):
    """Where the model-written code of tasks marked ``unsafe_code`` (humaneval, mbpp) runs."""

    #: Nowhere: lm-eval refuses such tasks (without ``confirm_run_unsafe_code``).
    OFF = "off"
    #: Each candidate in a bubblewrap sandbox (:mod:`rayeval.service.sandbox`), nowhere else.
    SANDBOX = "sandbox"
    #: In lm-eval's own way, in this host's processes with its network, files and environment
    #: (``rayeval run --confirm_run_unsafe_code --run_unsafe_code_unsandboxed`` only).
    HOST = "host"


@dataclass(frozen=True)
class HostOptions:
    """Where and how one evaluation runs, outside what it is.

    Args:
        output_path: Where lm-eval writes result and sample files (None: nowhere).
        include_paths: Directories of task YAMLs.
        address: Ray cluster address; None: ``RAY_ADDRESS`` or an embedded local Ray.
        name: Placement-group name / actor-name prefix (default: a random id).
        lm_eval: lm-eval's own host options (keys of :data:`LM_EVAL_HOST_FIELDS`), verbatim.
        trackers: The experiment trackers evaluations that ask to be tracked are recorded in.
        rank_niceness: The OS niceness of the rank processes, 0 to 19 (None: Ray's default for
            its workers, 15; the service passes its ``--rank-niceness``).
        code_execution: Where model-written code runs (:class:`CodeExecution`).
    """

    output_path: str | None = None
    include_paths: tuple[str, ...] = ()
    address: str | None = None
    name: str | None = None
    lm_eval: Mapping[str, Any] = field(default_factory=dict)
    trackers: Trackers = field(default_factory=Trackers)
    rank_niceness: int | None = None
    code_execution: CodeExecution = CodeExecution.OFF

    def __post_init__(self) -> None:
        unknown = sorted(set(self.lm_eval) - LM_EVAL_HOST_FIELDS)
        if unknown:
            raise ConfigError(f"not lm-eval host options: {unknown}")
        if self.rank_niceness is not None and not 0 <= self.rank_niceness <= 19:
            raise ConfigError(
                f"rank_niceness {self.rank_niceness} is not an OS niceness: give 0 (the node's "
                "default) to 19 (the lowest priority)"
            )
