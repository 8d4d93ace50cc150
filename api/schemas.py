"""Request and response bodies of the REST API (their shapes are what /docs shows).

``EvaluationCreate`` is the body of ``POST /evaluations``: lm-eval's ``run`` options that make
sense remotely, with lm-eval's names and meanings, plus the layout. Unknown fields are refused,
and lm-eval options that must not come from a client (task directories, output paths, remote
code) are refused with the reason. ``EvaluationPublic`` is what the API returns about one.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.group import Timeouts
from service.spec import (
    DEFAULT_BOOTSTRAP_ITERS,
    DEFAULT_SEED,
    EvaluationSpec,
    EvaluationStatus,
)

#: ``lm_eval run`` / ``rayeval run`` options that a request may not set, and why.
_NOT_SETTABLE = {
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
    "config": "send the options themselves in the body",
    "num_replicas": 'put it under "parallelism": {"num_replicas": R, "shard_size": G}',
    "shard_size": 'put it under "parallelism": {"num_replicas": R, "shard_size": G}',
    "cpus_per_rank": 'put it under "parallelism": {"cpus_per_rank": N}',
    "address": "the server's Ray cluster is fixed by its --ray-address",
    "placement_timeout": 'put it under "timeouts": {"placement_s": ...}',
    "load_timeout": 'put it under "timeouts": {"load_s": ...}',
    "step_timeout": 'put it under "timeouts": {"step_s": ...}',
    "collective_timeout": 'put it under "timeouts": {"collective_s": ...}',
}
_BATCH_SIZE = re.compile(r"^auto(:[1-9][0-9]*)?$")

_EXAMPLE: dict[str, Any] = {
    "model": "hf",
    "model_args": {"pretrained": "/models/llama-3-8b", "dtype": "bfloat16"},
    "tasks": ["hellaswag", "arc_easy"],
    "num_fewshot": 0,
    "batch_size": "auto",
    "log_samples": True,
    "parallelism": {"num_replicas": 2, "shard_size": 2},
}


class Parallelism(BaseModel):
    """The layout: R data-parallel replicas x G ranks per replica (one GPU or CPU slot each)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(
        default=1, ge=1, description="R: data-parallel replicas of the model."
    )
    shard_size: int = Field(
        default=1, ge=1, description="G: ranks per replica; FSDP2 over them if > 1."
    )
    cpus_per_rank: int = Field(
        default=1, ge=1, description="CPU slots per rank (on CPU ranks also torch's threads)."
    )


class TimeoutsIn(BaseModel):
    """Every wait of the run, in seconds (defaults as ``rayeval run``)."""

    model_config = ConfigDict(extra="forbid")

    placement_s: float = Field(
        default=Timeouts.placement_s, gt=0, description="Resources to be placed."
    )
    load_s: float = Field(
        default=Timeouts.load_s, gt=0, description="Every rank to load the model."
    )
    step_s: float = Field(default=Timeouts.step_s, gt=0, description="One batch on one replica.")
    collective_s: float = Field(default=Timeouts.collective_s, gt=0, description="One collective.")


class EvaluationCreate(BaseModel):
    """An evaluation to run: lm-eval's options (same names and meanings) plus the layout."""

    model_config = ConfigDict(
        extra="forbid", protected_namespaces=(), json_schema_extra={"examples": [_EXAMPLE]}
    )

    model: str = Field(default="hf", description='lm-eval model name; only "hf" is supported.')
    model_args: dict[str, Any] | str = Field(
        ...,
        description='lm-eval model args, as an object or as "pretrained=...,dtype=..."; '
        "pretrained (hub id or a path on the server) is required.",
    )
    tasks: list[str] | str = Field(
        ..., description="Task, group or tag names (glob patterns allowed), or 'a,b'."
    )
    num_fewshot: int | None = Field(default=None, ge=0)
    batch_size: int | str = Field(default="auto", description='An integer, "auto" or "auto:N".')
    max_batch_size: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(
        None, ge=1, description="Padded tokens per micro-batch with batch_size auto."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    limit: float | None = Field(default=None, gt=0, description="Docs per task (< 1: a fraction).")
    samples: dict[str, list[int]] | None = Field(
        None, description="Per task, the doc indices to evaluate (instead of limit)."
    )
    log_samples: bool = False
    predict_only: bool = False
    gen_kwargs: dict[str, Any] | str = Field(
        default_factory=dict, description='Generation overrides, object or "k=v,k2=v2".'
    )
    seed: int | list[int | None] = Field(
        default_factory=lambda: list[int | None](DEFAULT_SEED),
        description="One seed, or seeds for random, numpy, torch, few-shot.",
    )
    apply_chat_template: bool | str = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool | None = None
    bootstrap_iters: int = Field(default=DEFAULT_BOOTSTRAP_ITERS, ge=0)
    metadata: dict[str, Any] = Field(default_factory=dict)
    parallelism: Parallelism = Parallelism()
    timeouts: TimeoutsIn = TimeoutsIn()

    @model_validator(mode="before")
    @classmethod
    def _refuse_server_options(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refused = [f"{key}: {why}" for key, why in _NOT_SETTABLE.items() if key in data]
            if refused:
                raise ValueError("; ".join(refused))
        return data

    @field_validator("model_args", "gen_kwargs", mode="before")
    @classmethod
    def _parse_args_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            from lm_eval.utils import simple_parse_args_string

            try:
                return simple_parse_args_string(value)
            except (ValueError, IndexError):
                raise ValueError(
                    f"cannot parse {value!r}: use key=value pairs separated by commas"
                ) from None
        return value

    @field_validator("model_args")
    @classmethod
    def _needs_pretrained(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value.get("pretrained"):
            raise ValueError('needs pretrained: e.g. {"pretrained": "org/model-name"}')
        return value

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @field_validator("tasks")
    @classmethod
    def _names_not_paths(cls, value: list[str]) -> list[str]:
        names = [t.strip() for t in value if t.strip()]
        if not names:
            raise ValueError('name at least one task, e.g. ["hellaswag"]')
        paths = [n for n in names if "/" in n or "\\" in n or n.endswith((".yaml", ".yml"))]
        if paths:
            raise ValueError(
                f"{paths} look like paths: give task names; task files come only from the "
                "server's --include-path"
            )
        return list(dict.fromkeys(names))

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value >= 1:
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        if isinstance(value, str) and _BATCH_SIZE.match(value):
            return value
        raise ValueError(f'{value!r} is not a batch size: use an integer >= 1, "auto" or "auto:N"')

    def to_spec(self) -> EvaluationSpec:
        """The service's value object for this request."""
        assert isinstance(self.model_args, dict) and isinstance(self.tasks, list)
        assert isinstance(self.gen_kwargs, dict)
        return EvaluationSpec(
            model=self.model,
            model_args=dict(self.model_args),
            tasks=tuple(self.tasks),
            num_fewshot=self.num_fewshot,
            batch_size=self.batch_size,
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            device=self.device,
            limit=self.limit,
            samples=self.samples,
            log_samples=self.log_samples,
            predict_only=self.predict_only,
            gen_kwargs=dict(self.gen_kwargs),
            seed=tuple(self.seed) if isinstance(self.seed, list) else self.seed,
            apply_chat_template=self.apply_chat_template,
            system_instruction=self.system_instruction,
            fewshot_as_multiturn=self.fewshot_as_multiturn,
            bootstrap_iters=self.bootstrap_iters,
            metadata=dict(self.metadata),
            num_replicas=self.parallelism.num_replicas,
            shard_size=self.parallelism.shard_size,
            cpus_per_rank=self.parallelism.cpus_per_rank,
            timeouts=Timeouts(**self.timeouts.model_dump()),
        )

    @classmethod
    def from_spec(cls, spec: EvaluationSpec) -> EvaluationCreate:
        """The request as stored (after validation; ``device`` resolved against the cluster)."""
        data = spec.to_dict()
        data["parallelism"] = {
            "num_replicas": data.pop("num_replicas"),
            "shard_size": data.pop("shard_size"),
            "cpus_per_rank": data.pop("cpus_per_rank"),
        }
        return cls.model_validate(data)


class PhaseProgress(BaseModel):
    """Progress of one request type (lm-eval runs them one after the other)."""

    done: int
    total: int
    tokens_per_s: float
    real_token_fraction: float = Field(description="Real tokens / padded tokens computed.")


class ProgressPublic(BaseModel):
    """Requests done and known so far; a request type's total is known once it starts."""

    done: int
    total: int
    phases: dict[str, PhaseProgress]


class Throughput(BaseModel):
    """Speed of the run: tokens/s of the current request type, requests/s since it started."""

    tokens_per_s: float | None
    requests_per_s: float | None


class Links(BaseModel):
    """Where to find the evaluation's other resources."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    self_: str = Field(alias="self")
    events: str
    results: str
    samples: dict[str, str] = Field(description="Per task, its samples (with log_samples).")


class EvaluationPublic(BaseModel):
    """One evaluation: its state, progress, timestamps, error and request."""

    id: str
    status: EvaluationStatus
    queue_position: int | None = Field(description="1: next to start; null unless queued.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    progress: ProgressPublic
    throughput: Throughput
    stats: dict[str, Any] | None = Field(
        None, description="Per request type: requests, micro-batches, tokens/s (when finished)."
    )
    request: EvaluationCreate
    links: Links


class EvaluationList(BaseModel):
    """A page of evaluations, newest first."""

    items: list[EvaluationPublic]
    total: int
    limit: int
    offset: int


class Health(BaseModel):
    """Liveness of the service."""

    status: Literal["ok"] = "ok"
    ray_connected: bool
    task_index: str = Field(description="lm-eval's task index: building, ready or failed.")


class ErrorBody(BaseModel):
    """Every error response: what went wrong and how to fix it."""

    detail: str
