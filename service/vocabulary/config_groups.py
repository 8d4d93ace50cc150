"""Groups of an evaluation's configuration that the engine does not read: its scheduling in the
service's queue, and every wait of its run.

:class:`rayeval.service.vocabulary.config.EvaluationConfig` nests them (``"scheduling": {...}``,
``"timeouts": {...}``) and re-exports them, so callers import them from
:mod:`rayeval.service.vocabulary.config` as before. No torch here.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from rayeval.actors.layout import Timeouts


class Frozen(BaseModel):
    """A frozen configuration model that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Scheduling(Frozen):
    """Where the evaluation waits in the job service's queue (``rayeval run`` starts at once).

    The queue serves each user in turn (weighted fair share); these order an owner's own queue
    and say whether a running evaluation may give way to a more urgent one.
    """

    priority: StrictInt = Field(
        default=0,
        ge=-100,
        le=100,
        description="Order within its owner's own queue: higher first, ties oldest first "
        "(-100 to 100). A queued evaluation of higher priority may stop a running preemptible "
        "one.",
    )
    preemptible: StrictBool = Field(
        default=False,
        description="May be stopped to make room for an evaluation of higher priority: it goes "
        "back to the queue and, when it runs again, the response cache answers every request it "
        "had finished.",
    )


class TimeoutSettings(Frozen):
    """Every wait of the run, in seconds.

    The first four are the rank side's (:class:`rayeval.actors.layout.Timeouts`, with its
    defaults); ``control_s`` and ``reuse_s`` bound the service's calls to what an earlier
    evaluation kept loaded (warm replicas).
    """

    placement_s: float = Field(
        default=Timeouts.placement_s,
        gt=0,
        description="Seconds to wait for the cluster to provide the layout's resources.",
    )
    load_s: float = Field(
        default=Timeouts.load_s, gt=0, description="Seconds for every rank to load the model."
    )
    step_s: float = Field(
        default=Timeouts.step_s,
        gt=0,
        description="Seconds one batch may take on one replica before the run fails.",
    )
    collective_s: float = Field(
        default=Timeouts.collective_s,
        gt=0,
        description="Seconds one collective may take inside a replica.",
    )
    control_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a control call to a runner kept loaded by an earlier evaluation may "
        "take (handing it this evaluation; the runner waits up to a third of it for its previous "
        "run to end) before a new runner is started instead.",
    )
    reuse_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds the ranks kept loaded by an earlier evaluation have to begin this one "
        "(re-seeded) before new ranks are started instead.",
    )

    def for_ranks(self) -> Timeouts:
        """The rank side's value object: the waits of the ranks, with the same values."""
        return Timeouts(**self.model_dump(include=_RANK_TIMEOUTS))


#: The fields of :class:`TimeoutSettings` that are the rank side's :class:`Timeouts`.
_RANK_TIMEOUTS = {f.name for f in fields(Timeouts)}


#: Bounds of the seconds between two looks at a watched directory.
MIN_POLL_S, MAX_POLL_S = 0.1, 3600.0


class SweepSpec(Frozen):
    """The training checkpoints an evaluation runs over, on ranks started once: a fixed list (a
    sweep) or a watched directory (a watch). ``model_args.pretrained`` names the config and
    tokenizer; each checkpoint's results are kept apart (``GET /evaluations/{id}/sweep``)."""

    checkpoints: tuple[str, ...] | None = Field(
        default=None,
        min_length=1,
        max_length=10_000,
        description="Checkpoint directories (DCP, Hugging Face weights, or LoRA adapters: "
        "adapter_config.json + adapter_model.safetensors, applied to model_args.pretrained, "
        "which stays loaded) or globs such as /models/run/step-*, evaluated in this order (a "
        "glob's matches by step: trainer_state.json's global_step, else the name). The server "
        "expands the globs when it accepts the evaluation.",
    )
    watch: str | None = Field(
        default=None,
        min_length=1,
        description="A training run's checkpoint directory: each complete checkpoint that is or "
        "appears under it is evaluated once, until the evaluation is cancelled, max_checkpoints "
        "are evaluated, or timeout_s pass without a new one.",
    )
    poll_s: float = Field(
        default=30.0,
        ge=MIN_POLL_S,
        le=MAX_POLL_S,
        description="A watch: seconds between two looks at the directory.",
    )
    max_checkpoints: StrictInt | None = Field(
        default=None, ge=1, description="A watch: end after evaluating this many checkpoints."
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="A watch: end after this many seconds without a new checkpoint.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SweepSpec:
        if (self.checkpoints is None) == (self.watch is None):
            raise ValueError(
                'name the checkpoints ("checkpoints": [...]) or the directory to watch '
                '("watch": "..."), not both and not neither'
            )
        return self

    @property
    def kind(self) -> Literal["sweep", "watch"]:
        """``sweep`` (a list of checkpoints) or ``watch`` (a directory)."""
        return "watch" if self.watch is not None else "sweep"
