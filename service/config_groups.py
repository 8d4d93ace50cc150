"""Groups of an evaluation's configuration that the engine does not read: its scheduling in the
service's queue, and every wait of its run.

:class:`rayeval.service.config.EvaluationConfig` nests them (``"scheduling": {...}``,
``"timeouts": {...}``) and re-exports them, so callers import them from
:mod:`rayeval.service.config` as before. No torch here.
"""

from __future__ import annotations

from dataclasses import fields

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

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
