"""The engine: one evaluation's model on Ray replicas, with an explicit lifecycle.

:class:`Engine` is what :class:`rayeval.service.engine.lm.RayEvalLM` (lm-eval's adapter) drives:

* **create** (:meth:`Engine.__init__`): the model checked on the driver from a weightless copy
  (:mod:`rayeval.service.engine.plan.encoder`), Ray connected, the ranks placed and loading in
  the background (or kept replicas taken, :mod:`rayeval.service.engine.dispatch.warm`) — unless
  the response cache records this model evaluated to the end with these settings
  (:meth:`Engine.mark_evaluated`): then the ranks start only if an answer is not in the cache;
* **run a request type**: :meth:`~Engine.loglikelihood`, :meth:`~Engine.loglikelihood_rolling`,
  :meth:`~Engine.generate_until`. Each is one pipeline of shared stages: tokenise (lm-eval's
  own code), check, answer from the response cache, plan, dispatch, check that every micro-batch
  came back once, keep the figures (:class:`~rayeval.service.engine.dispatch.executor.Executor`).
  Planning in parts (:mod:`rayeval.service.engine.parts`) is an option of the same pipeline,
  taken when a request type has more requests than a part holds;
* **swap checkpoint** (:meth:`~Engine.swap_checkpoint`): another training checkpoint of the same
  model, read in place by the ranks;
* **keep or close** (:meth:`~Engine.close`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rayeval.actors.errors import ConfigError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind, ShardStrategy
from rayeval.actors.profiles import ModelShape
from rayeval.actors.protocol import InputTokens, LoadReport, RankSite, SwapReport
from rayeval.service.engine.dispatch.cluster import connect, embedded_cpus, pick_device
from rayeval.service.engine.dispatch.executor import Executor
from rayeval.service.engine.dispatch.phases import PhaseStats
from rayeval.service.engine.dispatch.warm import KeptReplicas, replica_key
from rayeval.service.engine.parts.generate import Prompts
from rayeval.service.engine.parts.pipeline import Tunables, even_bounds, part_bounds
from rayeval.service.engine.parts.score import score_tokens
from rayeval.service.engine.plan import model_shell
from rayeval.service.engine.plan.budgets import generation_slots, picked_budgets
from rayeval.service.engine.plan.checks import (
    Origins,
    RequestChecks,
    RequestReport,
    check_empty_context_pairs,
)
from rayeval.service.engine.plan.encoder import (
    build_encoder,
    model_sha,
    model_spec,
    rolling_windows,
)
from rayeval.service.engine.response_cache import answer_site, open_cache
from rayeval.service.engine.stages import Stages
from rayeval.service.private_apis import check_private_apis
from rayeval.service.vocabulary.config import DEFAULT_SEED, EngineConfig, HostOptions
from rayeval.service.vocabulary.events import OnWarning, Progress, RequestType, Stage, StageName

logger = logging.getLogger(__name__)

Pair = tuple[str, str]
Answer = tuple[float, bool]


@dataclass(frozen=True)
class Swap:
    """What swapping in another checkpoint took.

    Args:
        seconds: The whole swap, checks included.
        read_s: The slowest rank's read.
        bytes: Bytes read into all ranks.
    """

    seconds: float
    read_s: float
    bytes: int


class Engine:
    """One evaluation's model on ``config``'s R x G ranks (see the module's docstring).

    Args:
        config: The engine's configuration.
        host: Where it runs: the Ray address, the actors' name prefix, the response cache.
        on_progress: Called after every finished step.
        on_warning: Called with a ``RequestWarning`` when a task has loglikelihood
            requests whose tokens do not measure it (see :mod:`rayeval.service.engine.plan.checks`).
        replicas: Loaded replicas to use if they match, and where to keep these ones after a
            successful evaluation (:mod:`rayeval.service.engine.dispatch.warm`).
        tunables: What no user sets (part sizes, the rank class): tests and benchmarks only.
        on_stage: Called with each start-up stage (placing, loading m/n ranks while lm-eval
            builds its requests) and after each request type (lm-eval computes metrics).
        settings: A digest of the evaluation's other options
            (:func:`~rayeval.service.engine.response_cache.settings_digest`): where the response
            cache records this model evaluated to the end with them, the ranks start only when
            an answer is not in the cache. None: they start at once.

    Raises:
        ConfigError: an unsupported model arg or checkpoint (before any rank starts).
        LayoutError: a layout larger than the cluster.
    """

    def __init__(
        self,
        config: EngineConfig,
        host: HostOptions,
        on_progress: Callable[[Progress], None] | None = None,
        on_warning: OnWarning | None = None,
        replicas: KeptReplicas | None = None,
        tunables: Tunables | None = None,
        on_stage: Callable[[Stage], None] | None = None,
        settings: str | None = None,
    ) -> None:
        check_private_apis()  # names a package version that moved, before anything starts
        created = time.monotonic()
        self.config = config
        self.tunables = tunables or Tunables()
        self._timeouts = config.timeouts.for_ranks()
        self._on_warning = on_warning
        #: Degenerate loglikelihood requests seen so far, per task and kind (see engine.checks).
        self.request_report = RequestReport()
        model_args = {k: v for k, v in config.model_args.items() if k != "pretrained"}
        #: lm-eval's HF backend over the weightless model: every tokeniser rule is its own.
        self.encoder, self.dtype = build_encoder(config.pretrained, model_args)
        obstacles = model_shell.obstacles(self.encoder.model, config, self.encoder.tokenizer)
        if config.checkpoint:  # refused here, before any rank starts
            model_shell.check_checkpoint(config.checkpoint, self.encoder.model, config.pretrained)
        model_shell.check_adapters(config, self.encoder.model, self.encoder.tokenizer)
        cpus = embedded_cpus(config.layout(DeviceKind.CPU))
        self.connection = connect(host.address, embedded_cpus=cpus)
        self.layout = config.layout(pick_device(config.device))
        # Answers are keyed by where they are computed: known once the strategy is settled
        # (at once, unless ranks that start on demand must be placed to settle ``auto``).
        self._cache = open_cache(
            host.lm_eval.get("use_cache"),
            config.model_args,
            lambda: answer_site(self.layout.device, self.shard_strategy, self.dtype),
        )
        self.name = host.name or f"rayeval-{uuid.uuid4().hex[:8]}"
        #: Score inputs that share a prefix are packed into token-tree rows.
        self.share_prefixes = config.share_prefixes and model_shell.packing_supported(
            self.encoder.model, model_args, self.dtype
        )
        logger.info("starting %s on %s (%s)", self.name, self.layout.describe(), self.connection)
        vocab = ModelShape(self.encoder.model.config).vocab_size
        logger.info("%s: %s", self.name, picked_budgets(config, self.layout.device, vocab))
        torch_seed = config.seeds[2]
        seed = torch_seed if torch_seed is not None else DEFAULT_SEED[2]
        self._executor = Executor(
            config,
            self.layout.device,
            self._timeouts,
            self._cache,
            self.share_prefixes,
            seed,
            on_progress,
            created=created,
            shell=self.encoder.model,
            static_only=model_shell.static_generation_reason(
                config, self.encoder.model, self.encoder, self.dtype
            ),
        )
        self._replicas = replicas
        self._key = replica_key(config) if replicas is not None else ""
        spec = model_spec(
            config.pretrained,
            model_args,
            pad_token_id=self.encoder.tokenizer.pad_token_id,
            vocab_size=model_shell.adapter_vocab_size(
                config, self.encoder.model, self.encoder.tokenizer
            ),
        )
        self._settings = settings
        self._rank_niceness = host.rank_niceness
        self._stages = Stages(on_stage)
        self._group: WorkerGroup | None = None
        if self._evaluated_before():
            logger.info("%s: evaluated before, so its ranks start on demand", self.name)
            later = StageName.LOADING  # the requests are built when an answer is missing
            self._executor.start_on_demand(lambda: self._start(spec, obstacles, seed, later))
        else:
            self._start(spec, obstacles, seed, StageName.BUILDING_REQUESTS)

    # --------------------------------------------------------------------- lifecycle
    @property
    def shard_strategy(self) -> ShardStrategy:
        """How the replicas shard the model (FSDP for G = 1, where nothing is sharded). Before
        ranks that start on demand have started: the configured one, or, for ``auto`` at G > 1,
        the ranks are started to settle it."""
        if self._group is None:
            configured = self.config.parallelism.shard_strategy
            if not self.layout.sharded:
                return ShardStrategy.FSDP
            if configured is not ShardStrategy.AUTO:
                return configured
        return self._open().strategy

    def mark_evaluated(self) -> None:
        """Record in the response cache that this model was evaluated to the end with the
        settings given at construction: the next such evaluation starts no rank unless an answer
        is missing (nothing without a cache or settings)."""
        if self._cache is not None and self._settings is not None:
            self._cache.mark_evaluated(self._cache.fingerprint, self._settings)

    def _evaluated_before(self) -> bool:
        if self._cache is None or self._settings is None:
            return False
        return self._cache.evaluated(self._cache.fingerprint, self._settings)

    def _start(
        self, spec: Any, obstacles: dict[ShardStrategy, list[str]], seed: int, then: StageName
    ) -> None:
        """Place the ranks (or take kept ones), then follow their loading in stage ``then``."""
        self._stages.enter(StageName.PLACING, ranks=self.layout.world)
        self._group = self._start_group(spec, obstacles, seed)
        self._stages.follow(self._group)
        self._stages.enter(then)

    @property
    def load_reports(self) -> list[LoadReport]:
        """Per rank, after loading (waits for it): seconds, parameters held, peak memory."""
        return [] if self._group is None else self._group.wait_ready()

    def rank_sites(self) -> list[RankSite]:
        """Where each rank runs, as the rank actors report it (empty once closed)."""
        return [] if self._group is None else self._group.rank_sites()

    def input_token_counts(self) -> InputTokens:
        """Tokens the ranks' models were fed so far, counted at their input embeddings and
        summed over ranks. For benchmarks: model work measured, not estimated."""
        return self._open().input_token_counts(timeout_s=self._timeouts.step_s)

    @property
    def stats(self) -> dict[RequestType, PhaseStats]:
        """Per request type, what was computed and how fast (:class:`PhaseStats`)."""
        return self._executor.stats

    def model_info(self) -> dict[str, Any]:
        """What lm-eval's HF backend records about the model, plus the layout."""
        return {
            "model_num_parameters": self.encoder.model.num_parameters(),
            "model_dtype": str(self.dtype),
            "model_revision": self.encoder.revision,
            "model_sha": model_sha(self.config.pretrained, self.encoder.revision),
            "rayeval_layout": {
                "num_replicas": self.layout.num_replicas,
                "shard_size": self.layout.shard_size,
                "device": self.layout.device.value,
                # None for G = 1: nothing is sharded.
                "shard_strategy": self.shard_strategy.value if self.layout.sharded else None,
            },
        }

    def swap_checkpoint(self, checkpoint: str) -> Swap:
        """Evaluate another training checkpoint of this model from now on: checked on the
        driver, then swapped in place by the ranks, each reading only what it holds. The
        response cache and warm-replica key follow its fingerprint; the figures start afresh.

        Args:
            checkpoint: A DCP directory or HF weight files of this model's architecture.

        Raises:
            ConfigError: the checkpoint does not fit the model (nothing was swapped).
            ModelLoadError, EvaluationTimeoutError: a rank failed to read it; the ranks hold a
                mix of two checkpoints and are released, so this engine cannot go on.
        """
        for key in ("peft", "delta"):
            if self.config.model_args.get(key):
                raise ConfigError(
                    f"{key}= over training checkpoints is not supported: the checkpoints of a "
                    f"sweep replace pretrained's weights; evaluate {key}= with pretrained= alone"
                )
        group = self._open()
        started = time.monotonic()
        model_shell.check_checkpoint(checkpoint, self.encoder.model, self.config.pretrained)
        return self._swapped(
            started,
            lambda: group.load_checkpoint(checkpoint, timeout_s=self._timeouts.load_s),
            self.config.with_checkpoint(checkpoint),
        )

    def swap_adapter(self, peft: str) -> Swap:
        """Evaluate another checkpoint of the loaded LoRA adapter (``peft=``) from now on: the
        base stays loaded on every rank and only the adapter's matrices are overwritten. Checked
        on the driver first (the same LoRA config, matrices and shapes); the response cache and
        warm-replica key follow the new adapter; the figures start afresh.

        Raises:
            ConfigError: no adapter is loaded, or this one is not a checkpoint of the same LoRA
                run (nothing was swapped).
            ModelLoadError, EvaluationTimeoutError: a rank failed to read it; the ranks are
                released, so this engine cannot go on.
        """
        from rayeval.actors.weights.adapters import swap_problems

        loaded = self.config.model_args.get("peft")
        if not loaded:
            raise ConfigError(
                "swap_adapter: this engine applies no peft= adapter: start it with peft=..."
            )
        group = self._open()
        started = time.monotonic()
        swap_problems(str(loaded), peft, self.encoder.model, len(self.encoder.tokenizer))
        return self._swapped(
            started,
            lambda: group.load_adapter(peft, timeout_s=self._timeouts.load_s),
            self.config.model_copy(update={"model_args": {**self.config.model_args, "peft": peft}}),
        )

    def _swapped(
        self, started: float, swap: Callable[[], list[SwapReport]], config: EngineConfig
    ) -> Swap:
        """The ranks' ``swap`` done (the ranks released if it failed: they may hold a mix of
        two weights), then ``config`` is this engine's: the response cache and warm-replica key
        follow it and the figures start afresh."""
        try:
            reports = swap()
        except BaseException:
            self.close()
            raise
        self.config = config
        if self._cache is not None:
            self._cache.use_model(config.model_args)
        if self._replicas is not None:
            self._key = replica_key(config)
        read_s = max(r.seconds for r in reports)
        self._executor.begin_checkpoint(started, load_s=read_s)
        self.request_report = RequestReport()
        return Swap(time.monotonic() - started, read_s, sum(r.bytes for r in reports))

    def close(self, keep: bool = False) -> None:
        """Release the actors and the placement group. Safe to call more than once.

        Args:
            keep: Leave them loaded in the :class:`KeptReplicas` given at construction, if it
                asks to keep them.
        """
        self._stages.close()
        self._executor.start_on_demand(None)
        if self._group is not None:
            if keep and self._replicas is not None and self._replicas.keep:
                self._replicas.put(self._group, self._key)
            else:
                self._group.shutdown()
            self._group = None
            self._executor.attach(None)
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # -------------------------------------------------------------------- request types
    def loglikelihood(
        self, pairs: Sequence[Pair], origins: Origins, disable_tqdm: bool = False
    ) -> list[Answer]:
        """(log-likelihood, is_greedy) of each (context, continuation), in order; ``origins``
        names each request's task and document in errors and warnings."""
        if self.encoder.enable_thinking:
            raise ConfigError(
                "enable_thinking=True is not compatible with loglikelihood tasks: "
                "drop enable_thinking from model_args or run generative tasks only"
            )
        check_empty_context_pairs(pairs, origins, self.encoder.tok_encode)
        with self._computing():
            # TemplateLM's tokenisation, in bulk, and the checks (engine.parts.score).
            tokens = score_tokens(self.encoder, pairs, origins, self._checks())
            size = self.tunables.score_part
            if len(pairs) > size:  # tokenised (by actors), checked and planned in parts
                bounds = part_bounds([context for context, _ in pairs], size)
                return self._executor.score_parts(
                    len(pairs), bounds, tokens, self.encoder.max_length, disable_tqdm
                )
            part = tokens.make(0, len(pairs), None)
            scored = iter(self._score(part.pairs, RequestType.LOGLIKELIHOOD, disable_tqdm))
            return [part.fixed.get(i) or next(scored) for i in range(len(pairs))]

    def loglikelihood_tokens(
        self, requests: Sequence[tuple[Any, Sequence[int], Sequence[int]]], disable_tqdm: bool
    ) -> list[Answer]:
        """lm-eval's tokenised requests, ``((context, continuation), ctx_enc, cont_enc)``,
        scored; answers lm-eval gives without a model call are given so too."""
        fixed = self._checks()(requests, None, None).answers
        pairs = [(r[1], r[2]) for i, r in enumerate(requests) if i not in fixed]
        with self._computing():
            scored = iter(self._score(pairs, RequestType.LOGLIKELIHOOD, disable_tqdm))
            return [fixed.get(i) or next(scored) for i in range(len(requests))]

    def loglikelihood_rolling(
        self, texts: Sequence[str], disable_tqdm: bool = False
    ) -> list[float]:
        """The summed log-likelihood of each text over lm-eval's rolling windows."""
        windows, counts = rolling_windows(self.encoder, texts)
        with self._computing():
            answers = self._score(windows, RequestType.LOGLIKELIHOOD_ROLLING, disable_tqdm)
        totals, start = [], 0
        for count in counts:
            totals.append(sum(logprob for logprob, _ in answers[start : start + count]))
            start += count
        return totals

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """lm-eval's answer text of each ``generate_until`` request (its ``Instance``)."""
        prompts = Prompts(self.encoder, requests)  # lm-eval's tokenisation and decoding
        size = self.tunables.generate_part
        with self._computing():
            if len(requests) > size:  # tokenised, planned, decoded (by actors) in parts
                return self._executor.generate_parts(
                    len(requests),
                    even_bounds(len(requests), size),
                    prompts.tokens(),
                    prompts.settings(),
                    disable_tqdm,
                    prompts.decoding,
                )
            part = prompts.make(0, len(requests))
            generated = self._executor.generate(part.requests, disable_tqdm, part.names)
            return prompts.decode(generated)

    # ------------------------------------------------------------------------ internals
    def _score(
        self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], phase: RequestType, quiet: bool
    ) -> list[Answer]:
        return self._executor.score(pairs, self.encoder.max_length, phase, quiet)

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """A request type runs (its ranks loading first, if they still are); once it returned,
        lm-eval computes metrics unless another request type follows."""
        self._stages.enter(StageName.LOADING)
        yield
        self._stages.enter(StageName.COMPUTING_METRICS)

    def _checks(self) -> RequestChecks:
        """How loglikelihood requests are checked, and where findings are reported."""
        logits_cache = bool(self.config.model_args.get("logits_cache", True))
        tok_encode = self.encoder.tok_encode
        return RequestChecks(tok_encode, logits_cache, self.request_report, self._on_warning)

    def _open(self) -> WorkerGroup:
        """The ranks (those that start on demand start now); refused once closed."""
        if self._group is None:
            self._executor.start_now()
        if self._group is None:
            raise ConfigError("this engine was closed: create a new one to evaluate again")
        return self._group

    def _start_group(
        self, spec: Any, obstacles: dict[ShardStrategy, list[str]], seed: int
    ) -> WorkerGroup:
        """The kept replicas if they match and answer, else new ranks (loading in the
        background); the executor computes on them."""
        kept = None
        if self._replicas is not None:
            wait_s = min(self._timeouts.step_s, self.config.timeouts.reuse_s)
            kept = self._replicas.take_ready(self._key, seed, timeout_s=wait_s)
        parallelism = self.config.parallelism
        group = kept or WorkerGroup.create(
            self.name,
            self.layout,
            spec,
            self._timeouts,
            seed=seed,
            strategy=parallelism.shard_strategy,
            obstacles=obstacles,
            shm_collectives=parallelism.shm_collectives,
            logits_budget_mib=self.config.logits_budget_mib,
            generate_rows=generation_slots(self.config),
            rank_class=self.tunables.rank_class,
            niceness=self._rank_niceness,
        )
        self._executor.attach(group, reused=kept is not None)
        return group
