"""What one submitted evaluation asks for, and the states it goes through.

:class:`EvaluationSpec` is the service's value object for an evaluation, whatever door it came in
by (a REST body, a stored row): lm-eval's options, the layout and the engine's timeouts. It turns
into lm-eval's own ``EvaluatorConfig`` — lm-eval validates and interprets every option exactly as
``lm_eval run`` does — and into the layout the admission check reserves.
:class:`EvaluationStatus` is the lifecycle of an evaluation.

No torch here: the API process imports this module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from actors.errors import ConfigError
from actors.group import Timeouts
from actors.layout import DeviceKind, ParallelLayout

#: lm-eval's default seeds for random, numpy, torch and few-shot sampling (its ``DEFAULT_SEED``).
DEFAULT_SEED: tuple[int, ...] = (0, 1234, 1234, 1234)
#: lm-eval's default number of bootstrap iterations for metric standard errors.
DEFAULT_BOOTSTRAP_ITERS = 100000


class EvaluationStatus(StrEnum):
    """Where an evaluation is in its life: queued -> starting -> running -> a terminal state.

    ``starting`` covers reserving the layout, loading the model on every rank and building the
    requests; ``running`` begins when the first batch comes back.
    """

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True once nothing about the evaluation changes any more."""
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """True while a runner actor exists for the evaluation."""
        return self in ACTIVE_STATUSES


_TERMINAL = frozenset(
    {EvaluationStatus.SUCCEEDED, EvaluationStatus.FAILED, EvaluationStatus.CANCELLED}
)
ACTIVE_STATUSES = frozenset({EvaluationStatus.STARTING, EvaluationStatus.RUNNING})


@dataclass(frozen=True)
class EvaluationSpec:
    """Everything one evaluation needs, in lm-eval's terms plus the layout.

    Field meanings are lm-eval's (see ``lm_eval run --help``) unless noted.

    Args:
        model: lm-eval model name; rayeval runs the Hugging Face backend (``hf``).
        model_args: lm-eval's model args as a dict (``pretrained`` is required).
        tasks: Task, group or tag names (glob patterns allowed), never paths.
        num_replicas: R, data-parallel replicas of the model.
        shard_size: G, ranks per replica (FSDP2 over them when > 1).
        cpus_per_rank: CPU slots reserved per rank (on CPU ranks also torch's threads).
        device: ``auto``, ``cpu`` or ``cuda``; resolved against the cluster on submission.
        max_batch_tokens: rayeval's padded-token budget per micro-batch with ``batch_size=auto``.
        timeouts: Every wait of the run (placement, model load, one step, one collective).
        bootstrap_iters: Bootstrap iterations for standard errors (0: none).
    """

    model: str
    model_args: dict[str, Any]
    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    batch_size: int | str = "auto"
    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    device: str = "auto"
    limit: float | None = None
    samples: dict[str, list[int]] | None = None
    log_samples: bool = False
    predict_only: bool = False
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | tuple[int | None, ...] = DEFAULT_SEED
    apply_chat_template: bool | str = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool | None = None
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS
    metadata: dict[str, Any] = field(default_factory=dict)
    num_replicas: int = 1
    shard_size: int = 1
    cpus_per_rank: int = 1
    timeouts: Timeouts = field(default_factory=Timeouts)

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (what the store keeps); :meth:`from_dict` reads it back."""
        data = asdict(self)
        data["tasks"] = list(self.tasks)
        data["seed"] = list(self.seed) if isinstance(self.seed, tuple) else self.seed
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvaluationSpec:
        """Rebuild a spec from :meth:`to_dict` output (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown evaluation fields {unknown}: remove them")
        values = dict(data)
        values["tasks"] = tuple(values["tasks"])
        if isinstance(values.get("seed"), list):
            values["seed"] = tuple(values["seed"])
        if isinstance(values.get("timeouts"), dict):
            values["timeouts"] = Timeouts(**values["timeouts"])
        return cls(**values)

    def with_device(self, device: DeviceKind) -> EvaluationSpec:
        """This spec with ``device`` pinned (done once, at submission, against the cluster)."""
        return replace(self, device=device.value)

    def layout(self) -> ParallelLayout:
        """The layout this evaluation reserves; ``device`` must be resolved (not ``auto``).

        Raises:
            LayoutError: R or G out of range.
        """
        return ParallelLayout(
            self.num_replicas,
            self.shard_size,
            device=DeviceKind(self.device),
            cpus_per_rank=self.cpus_per_rank,
        )

    def evaluator_config(self, output_path: str, include_paths: tuple[str, ...]) -> Any:
        """lm-eval's ``EvaluatorConfig`` for this evaluation, validated by lm-eval itself.

        Args:
            output_path: Where lm-eval writes its result and sample files.
            include_paths: The server's task directories (never from the request).

        Returns:
            A configured ``lm_eval.config.evaluate_config.EvaluatorConfig``.

        Raises:
            ConfigError: lm-eval rejected a combination of options (message says which).
        """
        from lm_eval.config.evaluate_config import EvaluatorConfig

        cfg = EvaluatorConfig(
            model=self.model,
            model_args=dict(self.model_args),
            tasks=list(self.tasks),
            num_fewshot=self.num_fewshot,
            batch_size=self.batch_size,  # type: ignore[arg-type]  # lm-eval takes "auto" too
            max_batch_size=self.max_batch_size,
            device=self.device,
            limit=self.limit,
            samples=dict(self.samples) if self.samples is not None else None,
            log_samples=self.log_samples,
            predict_only=self.predict_only,
            output_path=output_path,
            system_instruction=self.system_instruction,
            apply_chat_template=self.apply_chat_template,
            fewshot_as_multiturn=self.fewshot_as_multiturn,
            include_path=list(include_paths) or None,  # type: ignore[arg-type]  # lists work
            gen_kwargs=dict(self.gen_kwargs),
            seed=list(self.seed) if isinstance(self.seed, tuple) else self.seed,
            metadata=dict(self.metadata),
        )
        try:
            return cfg._configure()
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{exc} (fix this in the request body)") from None
