"""``RayEvalLM``: an lm-eval ``LM`` whose requests run on Ray replicas of an FSDP2-sharded model.

lm-eval builds every request once, on the driver, and hands them to this class by request type.
Tokenisation is done here exactly as lm-eval's own HF backend does it — by an ``HFLM`` built over a
weightless (meta-device) copy of the model, so every tokenizer rule (BOS handling, pad token, chat
templates, max length) is lm-eval's own code. Only the forward passes leave the driver: the
planner cuts layout-independent micro-batches and the dispatcher runs them on the replicas.

Usage from Python, one line changed from a plain lm-eval script::

    with RayEvalLM(pretrained="meta-llama/Llama-3.1-8B", num_replicas=4, shard_size=2) as lm:
        results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

or by name: ``simple_evaluate(model="rayeval", model_args="pretrained=...,num_replicas=4")``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from rayeval.actors.batches import GenerateMicroBatch, MicroBatch, ModelSpec, ScoreMicroBatch
from rayeval.actors.checkpoints import resolve_dtype
from rayeval.actors.errors import ConfigError, RayEvalError, ResultIntegrityError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind
from rayeval.actors.profiles import ModelShape
from rayeval.actors.sharding import ShardStrategy, model_obstacles, refusal
from rayeval.service.config import (
    DEFAULT_CPU_SCORE_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_SEED,
    ENCODER_MODEL_ARGS,
    EngineConfig,
    HostOptions,
)
from rayeval.service.engine.checks import (
    Flagged,
    RequestReport,
    check_empty_context_pairs,
    inspect_requests,
)
from rayeval.service.engine.cluster import connect, pick_device
from rayeval.service.engine.dispatch import StepDone, run_steps
from rayeval.service.engine.planner import GenerateRequest, TokenBudget, plan_generate, plan_score
from rayeval.service.engine.response_cache import generate_key, open_cache, score_key
from rayeval.service.engine.warm import KeptReplicas, replica_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """Progress of one request type, reported after every finished step.

    Beyond the counts: ``seconds`` of the request type so far (its rate and ETA are
    ``done / seconds`` and ``(total - done) / rate``), requests it answered from the response
    cache, per replica what it computed (``{replica: {requests, tokens, busy_s}}``), per replica
    each shard rank's memory after its last micro-batch (``{replica: [{rss_mib, device_mib}]}``),
    and the engine's start-up: the slowest rank's model load and the seconds from the engine's
    start to its first batch.
    """

    phase: str
    done: int
    total: int
    tokens_per_s: float
    real_token_fraction: float
    seconds: float = 0.0
    cached: int = 0
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)
    rank_memory: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    load_s: float | None = None
    startup_s: float | None = None


@dataclass
class PhaseStats:
    """Throughput figures of one request type (for reports and benchmarks)."""

    requests: int = 0
    cached: int = 0
    micro_batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    replica_busy_s: dict[int, float] = field(default_factory=dict)
    replica_requests: dict[int, int] = field(default_factory=dict)
    replica_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def real_token_fraction(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def replica_utilisation(self) -> dict[int, float]:
        """Per replica: the share of the phase's wall time its slowest rank spent computing."""
        if self.seconds <= 0:
            return {}
        return {r: busy / self.seconds for r, busy in sorted(self.replica_busy_s.items())}

    def report(self) -> dict[str, Any]:
        """The figures as plain data (for logs, JSON and the CLI)."""
        return {
            "requests": self.requests,
            "cached": self.cached,
            "micro_batches": self.micro_batches,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "real_token_fraction": self.real_token_fraction,
            "replica_utilisation": self.replica_utilisation,
        }


@register_model("rayeval")
class RayEvalLM(TemplateLM):
    """Evaluate a Hugging Face causal LM on R x G Ray actors with results identical to lm-eval's HF.

    Built from an :class:`EngineConfig` (what ``rayeval run`` and the service do, through
    :meth:`from_config`), or from keywords, as lm-eval builds a model by name
    (``model_args="pretrained=...,num_replicas=4"``) and as a Python user writes it.

    Args:
        pretrained: Hub id or local path, as lm-eval's ``pretrained=`` (keywords form).
        config: The engine's configuration (instead of ``pretrained`` and ``options``).
        host: Where it runs: the Ray address and the actors' name prefix.
        on_progress: Called after every finished step.
        on_warning: Called with ``{task, counts, example}`` when a task has loglikelihood
            requests whose tokens do not measure it (see :mod:`rayeval.service.engine.checks`).
        **options: :meth:`EngineConfig.from_kwargs`'s keywords: ``num_replicas``, ``shard_size``,
            ``cpus_per_rank``, ``batch_size``, ``max_batch_size``, ``max_batch_tokens``,
            ``device``, ``seed``, ``timeouts`` (or ``placement_s``, ``load_s``, ...), ``address``,
            ``name`` and ``use_cache`` (a path prefix:
            :mod:`rayeval.service.engine.response_cache`); the rest are lm-eval's HF model args
            (``dtype``, ``revision``, ...).

    Raises:
        ConfigError: a bad option or an unsupported model arg.
        LayoutError: a layout larger than the cluster (fails before anything starts).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        config: EngineConfig | None = None,
        host: HostOptions | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_warning: Callable[[dict[str, Any]], None] | None = None,
        replicas: KeptReplicas | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self._created = time.monotonic()
        self._startup_s: float | None = None
        self._rank_memory: dict[str, list[dict[str, float]]] = {}
        if host is None:
            use_cache = options.pop("use_cache", None)
            host = HostOptions(
                address=options.pop("address", None),
                name=options.pop("name", None),
                lm_eval={"use_cache": use_cache} if use_cache else {},
            )
        if config is None:
            if pretrained is None:
                raise ConfigError("pass pretrained=<hub id or local path> (or a config)")
            config = EngineConfig.from_kwargs(pretrained, **options)
        elif pretrained is not None or options:
            raise ConfigError("pass either a config or pretrained=... with keywords, not both")
        self.config = config
        self.batch_sizes: dict[int, int] = {}
        self._timeouts = config.timeouts.for_ranks()
        self._on_progress = on_progress
        self._on_warning = on_warning
        self._origins: list[tuple[str, Any]] | None = None
        self.stats: dict[str, PhaseStats] = {}
        #: Degenerate loglikelihood requests seen so far, per task and kind (see engine.checks).
        self.request_report = RequestReport()
        self.pretrained = config.pretrained
        model_args = {k: v for k, v in config.model_args.items() if k != "pretrained"}
        self._encoder, self._dtype = _build_encoder(self.pretrained, model_args)
        self.tokenizer = self._encoder.tokenizer
        shard_size = config.parallelism.shard_size
        obstacles = (
            model_obstacles(self._encoder.model.config, shard_size) if shard_size > 1 else {}
        )
        requested = config.parallelism.shard_strategy
        if obstacles.get(requested):  # before anything starts
            raise ConfigError(refusal(requested, obstacles[requested]))
        self._cache = open_cache(host.lm_eval.get("use_cache"), config.model_args)

        self.connection = connect(host.address, config.layout(DeviceKind.CPU))
        self.layout = config.layout(pick_device(config.device))
        self._generate_budget = _budget(config)
        self._score_budget = _budget(config, score_on=self.layout.device)
        self.name = host.name or f"rayeval-{uuid.uuid4().hex[:8]}"
        spec = _model_spec(self.pretrained, model_args, pad_token_id=self.tokenizer.pad_token_id)
        self.share_prefixes = config.share_prefixes and self._packing_supported(model_args)
        logger.info("starting %s on %s (%s)", self.name, self.layout.describe(), self.connection)
        torch_seed = config.seeds[2]
        self._seed = torch_seed if torch_seed is not None else DEFAULT_SEED[2]
        self._replicas = replicas
        self._key = replica_key(config) if replicas is not None else ""
        kept = replicas.take(self._key) if replicas is not None else None
        if kept is not None:
            try:
                kept.begin_evaluation(self._seed, timeout_s=min(self._timeouts.step_s, 60.0))
            except RayEvalError as exc:
                logger.warning("the kept replicas cannot be reused (%s): starting new ones", exc)
                kept.shutdown()
                kept = None
        if replicas is not None:
            replicas.reused = kept is not None
        self._begun = self._reused = kept is not None
        self._group: WorkerGroup | None = kept or WorkerGroup.create(
            self.name,
            self.layout,
            spec,
            self._timeouts,
            seed=self._seed,
            strategy=config.parallelism.shard_strategy,
            obstacles=obstacles,
            shm_collectives=config.parallelism.shm_collectives,
        )
        self._strategy = self._group.strategy

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        host: HostOptions | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_warning: Callable[[dict[str, Any]], None] | None = None,
        replicas: KeptReplicas | None = None,
    ) -> RayEvalLM:
        """The engine for ``config`` (an :class:`EvaluationConfig` is one), started on ``host``.

        ``replicas``: loaded replicas to use if they match, and where to keep these ones after
        a successful evaluation (:mod:`rayeval.service.engine.warm`).
        """
        return cls(
            config=config,
            host=host,
            on_progress=on_progress,
            on_warning=on_warning,
            replicas=replicas,
        )

    # --------------------------------------------------------------------- lifecycle
    @property
    def load_reports(self) -> list[dict[str, Any]]:
        """Per rank, after loading: seconds, local parameter count, peak resident MiB."""
        if self._group is None:
            return []
        return self._group.wait_ready()

    def rank_sites(self) -> list[dict[str, Any]]:
        """Where each rank runs, as the rank actors report it: ``replica``, ``shard_rank``,
        ``node_id``, ``ip``, ``pid`` (empty once closed)."""
        if self._group is None:
            return []
        return self._group.rank_sites()

    def input_token_counts(self) -> dict[str, int]:
        """Tokens the ranks' models were fed so far, counted at their input embeddings and
        summed over ranks (``fed``: padding and dummy micro-batches included; ``real``: not
        the padding id; ``calls``). For benchmarks: model work measured, not estimated."""
        import ray

        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: read its token counts before close()")
        self._group.wait_ready()
        refs = [
            worker.input_token_counts.remote()
            for replica in self._group.replicas
            for worker in replica.workers
        ]
        totals: Counter[str] = Counter()
        for counts in ray.get(refs, timeout=self._timeouts.step_s):
            totals.update(counts)
        return dict(totals)

    @property
    def shard_strategy(self) -> ShardStrategy:
        """How the replicas shard the model (settled when the ranks were placed)."""
        return self._strategy

    def close(self, keep: bool = False) -> None:
        """Release the actors and the placement group. Safe to call more than once.

        Args:
            keep: Leave them loaded in the :class:`KeptReplicas` given at construction, if it
                asks to keep them (the ``with`` block does so when it ends without an error).
        """
        if self._group is not None:
            if keep and self._replicas is not None and self._replicas.keep:
                self._replicas.put(self._group, self._key)
            else:
                self._group.shutdown()
            self._group = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __enter__(self) -> RayEvalLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(keep=exc_type is None)

    # ------------------------------------------------------- tokenisation (lm-eval's own)
    @property
    def eot_token_id(self) -> int:
        return self._encoder.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self._encoder.prefix_token_id

    @property
    def max_length(self) -> int:
        return self._encoder.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._encoder.max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self._encoder.tokenizer_name

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self._encoder.tok_encode(string, **kwargs)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self._encoder.apply_chat_template(chat_history, add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval's HF backend records about the model, plus the layout."""
        return {
            "model_num_parameters": self._encoder.model.num_parameters(),
            "model_dtype": str(self._dtype),
            "model_revision": self._encoder.revision,
            "model_sha": _model_sha(self.pretrained, self._encoder.revision),
            "rayeval_layout": {
                "num_replicas": self.layout.num_replicas,
                "shard_size": self.layout.shard_size,
                "device": self.layout.device.value,
                # None for G = 1: nothing is sharded.
                "shard_strategy": self.shard_strategy.value if self.layout.sharded else None,
            },
        }

    # -------------------------------------------------------------------- request types
    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        if self._encoder.enable_thinking:
            raise ConfigError(
                "enable_thinking=True is not compatible with loglikelihood tasks: "
                "drop enable_thinking from model_args or run generative tasks only"
            )
        origins = [(r.task_name, r.doc_id) for r in requests]
        check_empty_context_pairs([r.args for r in requests], origins, self.tok_encode)
        self._origins = origins
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._origins = None

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score tokenised pairs; answers lm-eval gives without a model call are given so too.

        ``requests`` are lm-eval's ``((context, continuation), ctx_enc, cont_enc)`` in the
        order of the Instances given to :meth:`loglikelihood` (their origins name the task
        in reports and errors).
        """
        inspection = inspect_requests(
            requests,
            self._origins
            if self._origins is not None and len(self._origins) == len(requests)
            else None,
            self.tok_encode,
            logits_cache=bool(self.config.model_args.get("logits_cache", True)),
        )
        for flagged in inspection.flagged:
            self.request_report.add(flagged)
        self._warn_about(inspection.flagged)
        todo = [i for i in range(len(requests)) if i not in inspection.answers]
        scored = self._score(
            [(requests[i][1], requests[i][2]) for i in todo], "loglikelihood", disable_tqdm
        )
        answers = dict(inspection.answers) | dict(zip(todo, scored, strict=True))
        ordered = [answers[i] for i in range(len(requests))]
        for (request_str, _, _), answer in zip(requests, ordered, strict=True):
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return ordered

    def _warn_about(self, flagged: list[Flagged]) -> None:
        """Log, and report through ``on_warning``, the degenerate requests of one call per task."""
        by_task: dict[str, list[Flagged]] = {}
        for item in flagged:
            by_task.setdefault(item.task, []).append(item)
        for task, items in by_task.items():
            kinds = Counter(item.kind.value for item in items)
            example = items[0]
            logger.warning(
                "task %s: %s loglikelihood requests whose tokens do not measure the task "
                "(%s; e.g. doc %s, continuation %r): scored as lm-eval's hf backend scores them",
                task,
                sum(kinds.values()),
                ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
                example.doc_id,
                example.continuation,
            )
            if self._on_warning is not None:
                self._on_warning(
                    {"task": task, "counts": dict(kinds), "example": example.example()}
                )

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        counts = []
        for (string,) in (request.args for request in requests):
            doc_windows = [
                lm_utils.make_disjoint_window(window)
                for window in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += doc_windows
            counts.append(len(doc_windows))
        answers = self._score(windows, "loglikelihood_rolling", disable_tqdm)
        totals: list[float] = []
        start = 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in answers[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self._encoder.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prepared = [
            self._generate_request(context, gen_kwargs, eos)
            for context, gen_kwargs in (r.args for r in requests)
        ]
        keys = [
            generate_key(
                request.context,
                {
                    "max_gen_toks": request.max_gen_toks,
                    "until": list(request.until),
                    "max_length": request.max_length,
                    "kwargs": request.kwargs,
                },
            )
            for request in prepared
        ]
        cached, todo = self._cached(keys, "generate_until")
        plan = plan_generate([prepared[i] for i in todo], self._generate_budget)
        located = [
            (keys[i], mb, (position,))
            for i, (mb, position) in zip(todo, plan.locations, strict=True)
        ]
        outputs = self._run(
            plan.micro_batches,
            "generate_until",
            Counter(mb for mb, _ in plan.locations),
            disable_tqdm,
            on_result=self._store_answers(located),
        )
        generated = dict(cached) | {
            i: outputs[mb][position] for i, (mb, position) in zip(todo, plan.locations, strict=True)
        }
        think_end = self._encoder.think_end_token
        texts = []
        for index, (request, prepared_request) in enumerate(zip(requests, prepared, strict=True)):
            tokens = list(generated[index])
            if isinstance(think_end, int) and think_end in tokens:
                tokens = tokens[len(tokens) - tokens[::-1].index(think_end) :]
            text = self._encoder.tok_decode(tokens)
            if isinstance(think_end, int):
                text = text.lstrip()
            text = postprocess_generated_text(
                generation=text,
                stop=list(prepared_request.until),
                think_end_token=think_end if isinstance(think_end, str) else None,
            )
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    # ------------------------------------------------------------------------ internals
    def _packing_supported(self, model_args: dict[str, Any]) -> bool:
        """Whether the ranks' model scores packed rows exactly (else: one row per input)."""
        shell = self._encoder.model
        implementation = model_args.get("attn_implementation") or getattr(
            shell.config, "_attn_implementation", None
        )
        reason = ModelShape(shell.config).packing_unsupported(implementation)
        if reason is not None:
            logger.info("shared prefixes are computed once per request (not packed): %s", reason)
        return reason is None

    def _generate_request(
        self, context: str, gen_kwargs: dict[str, Any], eos: str
    ) -> GenerateRequest:
        """Tokenise one generate_until request as lm-eval's HF ``generate_until`` does."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        max_ctx_len = self.max_length - max_gen_toks
        if max_ctx_len <= 0:
            raise ConfigError(
                f"max_gen_toks ({max_gen_toks}) must be below the model's max_length "
                f"({self.max_length}): lower max_gen_toks in --gen_kwargs or the task"
            )
        # tok_batch_encode's rules for one string: BOS-prefixed text gets no special tokens.
        special: dict[str, bool] = {}
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self._encoder.add_bos_token is not None:
            special = {"add_special_tokens": self._encoder.add_bos_token}
        ids = self.tokenizer(context, truncation=self._encoder.truncation, **special)["input_ids"]
        return GenerateRequest(
            context=tuple(ids[-max_ctx_len:]),
            max_gen_toks=max_gen_toks,
            until=tuple(until),
            max_length=kwargs.pop("max_length", None),
            kwargs=kwargs,
        )

    def _score(
        self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], phase: str, disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        keys = [
            score_key(context, continuation, self.max_length) for context, continuation in pairs
        ]
        cached, todo = self._cached(keys, phase)
        plan = plan_score(
            [pairs[i] for i in todo], self.max_length, self._score_budget, self.share_prefixes
        )
        located = [
            (keys[i], loc.micro_batch, (loc.row, loc.target))
            for i, loc in zip(todo, plan.locations, strict=True)
        ]
        results = self._run(
            plan.micro_batches,
            phase,
            Counter(loc.micro_batch for loc in plan.locations),
            disable_tqdm,
            on_result=self._store_answers(located),
        )
        answers = dict(cached) | {
            i: results[loc.micro_batch][loc.row][loc.target]
            for i, loc in zip(todo, plan.locations, strict=True)
        }
        return [answers[i] for i in range(len(pairs))]

    def _cached(self, keys: Sequence[Any], phase: str) -> tuple[dict[int, Any], list[int]]:
        """Answers the response cache has (position -> answer), and the positions to compute."""
        cached = self._cache.get_many(keys) if self._cache is not None else {}
        if cached:
            self.stats.setdefault(phase, PhaseStats()).cached += len(cached)
            logger.info(
                "%s: %d of %d requests answered from the cache", phase, len(cached), len(keys)
            )
        return cached, [i for i in range(len(keys)) if i not in cached]

    def _store_answers(
        self, located: Sequence[tuple[Any, int, tuple[int, ...]]]
    ) -> Callable[[int, Any], None] | None:
        """A callback that stores a finished micro-batch's answers in the response cache.

        Args:
            located: Per computed request: its cache key, its micro-batch, and where its answer
                is inside that micro-batch's result.
        """
        if self._cache is None:
            return None
        cache = self._cache
        by_micro_batch: dict[int, list[tuple[Any, tuple[int, ...]]]] = {}
        for key, micro_batch, path in located:
            by_micro_batch.setdefault(micro_batch, []).append((key, path))

        def store(micro_batch: int, result: Any) -> None:
            answers = []
            for key, path in by_micro_batch.get(micro_batch, []):
                answer = result
                for part in path:
                    answer = answer[part]
                answers.append((key, answer))
            cache.put_many(answers)

        return store

    def _run(
        self,
        micro_batches: Sequence[MicroBatch],
        phase: str,
        requests_per_micro_batch: Counter[int],
        disable_tqdm: bool,
        on_result: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: create a new one to evaluate again")
        load_reports = self._group.wait_ready()
        if not self._begun:  # seeded after loading, as kept replicas are: same samples
            self._group.begin_evaluation(self._seed, timeout_s=self._timeouts.step_s)
            self._begun = True
        if self._startup_s is None:
            self._startup_s = time.monotonic() - self._created
        # Kept replicas loaded nothing for this evaluation.
        load_s = 0.0 if self._reused else max((r["seconds"] for r in load_reports), default=None)
        total = sum(requests_per_micro_batch.values())
        stats = self.stats.setdefault(phase, PhaseStats())
        stats.requests += total
        stats.micro_batches += len(micro_batches)
        for replica in range(self.layout.num_replicas):  # idle replicas report 0, not nothing
            stats.replica_busy_s.setdefault(replica, 0.0)
        started = time.monotonic()
        base_seconds = stats.seconds
        bar = tqdm(total=total, desc=f"rayeval {phase}", disable=disable_tqdm, unit="req")
        done = 0

        def on_step(step: StepDone) -> None:
            nonlocal done
            count = sum(requests_per_micro_batch[i] for i in step.micro_batches)
            done += count
            stats.real_tokens += sum(s.real_tokens for s in step.stats)
            stats.padded_tokens += sum(s.padded_tokens for s in step.stats)
            busy = max(s.seconds for s in step.stats)
            replica = step.replica
            stats.replica_busy_s[replica] = stats.replica_busy_s.get(replica, 0.0) + busy
            stats.replica_requests[replica] = stats.replica_requests.get(replica, 0) + count
            stats.replica_tokens[replica] = stats.replica_tokens.get(replica, 0) + sum(
                s.real_tokens for s in step.stats
            )
            self._rank_memory[str(replica)] = [
                {"rss_mib": s.rss_mib, "device_mib": s.device_mib} for s in step.stats
            ]
            stats.seconds = base_seconds + time.monotonic() - started
            if on_result is not None:
                for micro_batch, result in zip(step.micro_batches, step.results, strict=True):
                    on_result(micro_batch, result)
            bar.update(count)
            bar.set_postfix(
                tok_s=f"{stats.tokens_per_s:,.0f}", real=f"{stats.real_token_fraction:.2f}"
            )
            if self._on_progress is not None:
                self._on_progress(
                    Progress(
                        phase,
                        done,
                        total,
                        stats.tokens_per_s,
                        stats.real_token_fraction,
                        seconds=stats.seconds,
                        cached=stats.cached,
                        replicas={
                            str(r): {
                                "requests": stats.replica_requests.get(r, 0),
                                "tokens": stats.replica_tokens.get(r, 0),
                                "busy_s": busy_s,
                            }
                            for r, busy_s in sorted(stats.replica_busy_s.items())
                        },
                        rank_memory=dict(self._rank_memory),
                        load_s=load_s,
                        startup_s=self._startup_s,
                    )
                )

        try:
            results = run_steps(self._group, micro_batches, self._timeouts.step_s, on_step)
        finally:
            bar.close()
        _check_exactly_once(micro_batches, results)
        return results


def _check_exactly_once(micro_batches: Sequence[MicroBatch], results: Sequence[Any]) -> None:
    """Every micro-batch came back once, with one answer per row (per target for scores)."""
    for index, (batch, result) in enumerate(zip(micro_batches, results, strict=True)):
        if isinstance(batch, ScoreMicroBatch):
            expected = [len(row.targets) for row in batch.rows]
            got = [len(row) for row in result] if result is not None else None
        else:
            assert isinstance(batch, GenerateMicroBatch)
            expected = [1] * len(batch.contexts)
            got = [1] * len(result) if result is not None else None
        if got != expected:
            raise ResultIntegrityError(
                f"micro-batch {index} came back with {got} answers, expected {expected} "
                "(a request id is missing or duplicated: please report this bug)"
            )


def _budget(config: EngineConfig, score_on: DeviceKind | None = None) -> TokenBudget:
    """Micro-batch limits: a token budget with ``auto``, lm-eval's rows per batch otherwise.

    ``score_on``: the budget of scoring micro-batches on ranks of that device. CPU ranks score
    with a smaller default token budget than GPUs: a CPU forward over 1-2k tokens runs faster
    per token than one over 4-8k, whose activations outgrow the caches (measured in
    docs/performance.md), and narrower micro-batches pad less. Generation keeps the larger
    budget on every device: each decode step costs a forward of one token per row, and under
    FSDP one all-gather of every weight for the whole micro-batch, so wider is faster.
    """
    if isinstance(config.batch_size, str):  # "auto" or "auto:N" (validated by the config)
        default = DEFAULT_MAX_BATCH_TOKENS
        if score_on is DeviceKind.CPU:
            default = DEFAULT_CPU_SCORE_BATCH_TOKENS
        return TokenBudget(
            max_tokens=config.max_batch_tokens or default,
            max_rows=config.max_batch_size or DEFAULT_MAX_BATCH_ROWS,
        )
    return TokenBudget(max_tokens=config.max_batch_tokens or 2**62, max_rows=config.batch_size)


def _build_encoder(pretrained: str, model_args: dict[str, Any]) -> tuple[HFLM, torch.dtype]:
    """lm-eval's own HFLM over a weightless copy of the model: the driver's tokeniser."""
    common = {
        "revision": str(model_args.get("revision", "main")),
        "subfolder": model_args.get("subfolder", ""),
        "trust_remote_code": bool(model_args.get("trust_remote_code", False)),
    }
    try:
        config = transformers.AutoConfig.from_pretrained(pretrained, **common)
    except OSError as exc:
        raise ConfigError(
            f"cannot load model {pretrained!r}: {exc}. Pass an existing local path or a Hugging "
            "Face hub id as pretrained=..."
        ) from exc
    dtype = resolve_dtype(model_args.get("dtype", "auto"), config)
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=common["trust_remote_code"]
        )
    encoder_kwargs = {k: v for k, v in model_args.items() if k in ENCODER_MODEL_ARGS}
    encoder_kwargs.setdefault("tokenizer", pretrained)
    encoder = HFLM(pretrained=shell, backend="causal", **common, **encoder_kwargs)
    return encoder, dtype


def _model_spec(pretrained: str, model_args: dict[str, Any], pad_token_id: int) -> ModelSpec:
    handled = ENCODER_MODEL_ARGS | {
        "revision",
        "subfolder",
        "trust_remote_code",
        "dtype",
        "backend",
        "logits_cache",
        "softmax_dtype",
        "mixed_precision_dtype",
    }
    tokenizer = model_args.get("tokenizer")
    return ModelSpec(
        pretrained=pretrained,
        revision=str(model_args.get("revision", "main")),
        subfolder=model_args.get("subfolder", ""),
        dtype=str(model_args.get("dtype", "auto")),
        trust_remote_code=bool(model_args.get("trust_remote_code", False)),
        tokenizer=tokenizer if isinstance(tokenizer, str) else None,
        pad_token_id=pad_token_id,
        softmax_dtype=model_args.get("softmax_dtype"),
        mixed_precision_dtype=model_args.get("mixed_precision_dtype"),
        extra_kwargs={k: v for k, v in model_args.items() if k not in handled},
    )


def _model_sha(pretrained: str, revision: str) -> str:
    """The hub commit of the model, as lm-eval records it; empty for local paths or offline."""
    import os

    if os.path.isdir(pretrained) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return ""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id=pretrained, revision=revision).sha or ""
    except Exception:  # lm-eval records "" whenever the hub cannot say
        return ""
