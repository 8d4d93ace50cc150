"""``RayEvalLM``: an lm-eval ``LM`` whose requests run on Ray replicas of a sharded model.

lm-eval builds every request once, on the driver, and hands them to this class by request type.
Tokenisation is done here exactly as lm-eval's own HF backend does it — by an ``HFLM`` built over a
weightless (meta-device) copy of the model (:mod:`rayeval.service.engine.plan.encoder`), so every
tokenizer rule (BOS handling, pad token, chat templates, max length) is lm-eval's own code. Only
the forward passes leave the driver: the planner cuts layout-independent micro-batches and the
dispatcher runs them on the replicas.

Usage from Python, one line changed from a plain lm-eval script::

    with RayEvalLM(pretrained="meta-llama/Llama-3.1-8B", num_replicas=4, shard_size=2) as lm:
        results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

or by name: ``simple_evaluate(model="rayeval", model_args="pretrained=...,num_replicas=4")``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from rayeval.actors.errors import ConfigError, RayEvalError
from rayeval.actors.group import WorkerGroup
from rayeval.actors.layout import DeviceKind, ShardStrategy
from rayeval.actors.protocol import LoadReport
from rayeval.service.engine.dispatch.cluster import connect, pick_device
from rayeval.service.engine.dispatch.executor import Executor
from rayeval.service.engine.dispatch.phases import PhaseStats
from rayeval.service.engine.dispatch.warm import KeptReplicas, replica_key
from rayeval.service.engine.parts.generate import Prompts
from rayeval.service.engine.parts.pipeline import (
    Tunables,
    even_bounds,
    part_bounds,
)
from rayeval.service.engine.parts.score import score_tokens
from rayeval.service.engine.plan import model_shell
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
from rayeval.service.engine.response_cache import open_cache
from rayeval.service.private_apis import check_private_apis
from rayeval.service.vocabulary.config import DEFAULT_SEED, EngineConfig, HostOptions
from rayeval.service.vocabulary.config_fields import config_from_keywords
from rayeval.service.vocabulary.doors import Door, reword
from rayeval.service.vocabulary.events import Progress, RequestType

logger = logging.getLogger(__name__)


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
            requests whose tokens do not measure it (see :mod:`rayeval.service.engine.plan.checks`).
        replicas: Loaded replicas to use if they match, and where to keep these ones after a
            successful evaluation (:mod:`rayeval.service.engine.dispatch.warm`).
        tunables: What no user sets (part sizes, the rank class): tests and benchmarks only.
        **options: :func:`~rayeval.service.vocabulary.config_fields.config_from_keywords`'s
        keywords:
            ``num_replicas``, ``shard_size``, ``cpus_per_rank``, ``batch_size``, ``max_batch_size``,
            ``max_batch_tokens``, ``device``, ``seed``, ``timeouts`` (or ``placement_s``,
            ``load_s``, ...), ``address``, ``name`` and ``use_cache`` (a path prefix:
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
        tunables: Tunables | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        try:
            self._start(
                pretrained, config, host, on_progress, on_warning, replicas, tunables, options
            )
        except RayEvalError as exc:
            if config is None:  # built from keywords: the fields it names are keywords too
                reword(exc, Door.PYTHON)
            raise

    def _start(
        self,
        pretrained: str | None,
        config: EngineConfig | None,
        host: HostOptions | None,
        on_progress: Callable[[Progress], None] | None,
        on_warning: Callable[[dict[str, Any]], None] | None,
        replicas: KeptReplicas | None,
        tunables: Tunables | None,
        options: dict[str, Any],
    ) -> None:
        """What ``__init__`` does: check, build the driver's encoder, start the ranks."""
        self._tunables = tunables or Tunables()
        check_private_apis()  # names a package version that moved, before anything starts
        self._created = time.monotonic()
        config, host = _engine_config(pretrained, config, host, options)
        self.config = config
        self.batch_sizes: dict[int, int] = {}
        self._timeouts = config.timeouts.for_ranks()
        self._on_warning = on_warning
        #: Degenerate loglikelihood requests seen so far, per task and kind (see engine.checks).
        self.request_report = RequestReport()
        self.pretrained = config.pretrained
        model_args = {k: v for k, v in config.model_args.items() if k != "pretrained"}
        self._encoder, self._dtype = build_encoder(self.pretrained, model_args)
        self.tokenizer = self._encoder.tokenizer
        obstacles = model_shell.obstacles(self._encoder.model, config)
        if config.model_args.get("checkpoint"):  # refused here, before any rank starts
            model_shell.check_checkpoint(
                str(config.model_args["checkpoint"]), self._encoder.model, self.pretrained
            )
        self._cache = open_cache(host.lm_eval.get("use_cache"), config.model_args)
        self.connection = connect(host.address, config.layout(DeviceKind.CPU))
        self.layout = config.layout(pick_device(config.device))
        self.name = host.name or f"rayeval-{uuid.uuid4().hex[:8]}"
        self.share_prefixes = config.share_prefixes and model_shell.packing_supported(
            self._encoder.model, model_args
        )
        logger.info("starting %s on %s (%s)", self.name, self.layout.describe(), self.connection)
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
            created=self._created,
            shell=self._encoder.model,
            static_only=model_shell.static_generation_reason(
                config, self._encoder.model, self._encoder
            ),
        )
        self._replicas = replicas
        self._key = replica_key(config) if replicas is not None else ""
        self._group: WorkerGroup | None = self._start_group(model_args, obstacles, seed)
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
        a successful evaluation (:mod:`rayeval.service.engine.dispatch.warm`).
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
    def load_reports(self) -> list[LoadReport]:
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
        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: read its token counts before close()")
        return self._group.input_token_counts(timeout_s=self._timeouts.step_s)

    @property
    def stats(self) -> dict[RequestType, PhaseStats]:
        """Per request type, what was computed and how fast (:class:`PhaseStats`)."""
        return self._executor.stats

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
            self._executor.attach(None)
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def load_checkpoint(self, checkpoint: str) -> dict[str, Any]:
        """Evaluate another training checkpoint of this model from now on: checked on the
        driver, then swapped in place by the ranks, each reading only what it holds. The
        response cache and warm-replica key follow its fingerprint; the figures start afresh.

        Args:
            checkpoint: A DCP directory or HF weight files of this model's architecture.

        Returns:
            ``seconds`` (the whole swap), ``read_s`` (the slowest rank's read) and ``bytes``
            (read into all ranks).

        Raises:
            ConfigError: the checkpoint does not fit the model (nothing was swapped).
            ModelLoadError, EvaluationTimeoutError: a rank failed to read it; the ranks hold a
                mix of two checkpoints and are released, so this engine cannot go on.
        """
        if self._group is None:
            raise ConfigError("this RayEvalLM was closed: create a new one to evaluate again")
        started = time.monotonic()
        model_shell.check_checkpoint(checkpoint, self._encoder.model, self.pretrained)
        try:
            reports = self._group.load_checkpoint(checkpoint, timeout_s=self._timeouts.load_s)
        except BaseException:
            self.close()
            raise
        args = {**self.config.model_args, "checkpoint": checkpoint}
        self.config = self.config.model_copy(update={"model_args": args})
        if self._cache is not None:
            self._cache.use_model(args)
        if self._replicas is not None:
            self._key = replica_key(self.config)
        read_s = max(r.seconds for r in reports)
        self._executor.begin_checkpoint(started, load_s=read_s)
        self.request_report = RequestReport()
        return {
            "seconds": time.monotonic() - started,
            "read_s": read_s,
            "bytes": sum(r.bytes for r in reports),
        }

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
            "model_sha": model_sha(self.pretrained, self._encoder.revision),
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
        origins = Origins(requests)
        pairs = [r.args for r in requests]
        check_empty_context_pairs(pairs, origins, self.tok_encode)
        # TemplateLM's tokenisation, in bulk, and the checks (engine.parts.score).
        tokens = score_tokens(self._encoder, pairs, origins, self._checks())
        size = self._tunables.score_part
        if len(pairs) > size:  # tokenised (by actors), checked and planned in parts
            bounds = part_bounds([context for context, _ in pairs], size)
            answers = self._executor.score_parts(
                len(pairs), bounds, tokens, self.max_length, disable_tqdm
            )
            return self._hooked(pairs, answers)
        part = tokens.make(0, len(pairs), None)
        scored = iter(
            self._executor.score(
                part.pairs, self.max_length, RequestType.LOGLIKELIHOOD, disable_tqdm
            )
        )
        fixed = part.fixed
        return self._hooked(pairs, [fixed.get(i) or next(scored) for i in range(len(pairs))])

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score lm-eval's tokenised requests, ``((context, continuation), ctx_enc,
        cont_enc)``; answers lm-eval gives without a model call are given so too."""
        fixed = self._checks()(requests, None, None).answers
        pairs = [(requests[i][1], requests[i][2]) for i in range(len(requests)) if i not in fixed]
        scored = iter(
            self._executor.score(pairs, self.max_length, RequestType.LOGLIKELIHOOD, disable_tqdm)
        )
        answers = [fixed.get(i) or next(scored) for i in range(len(requests))]
        return self._hooked([request[0] for request in requests], answers)

    def _checks(self) -> RequestChecks:
        """How loglikelihood requests are checked, and where findings are reported."""
        logits_cache = bool(self.config.model_args.get("logits_cache", True))
        return RequestChecks(self.tok_encode, logits_cache, self.request_report, self._on_warning)

    def _hooked(self, requests: list[Any], answers: list[Any]) -> list[Any]:
        """lm-eval's cache hook given each (context, continuation) request's answer."""
        for request, answer in zip(requests, answers, strict=True):
            if request is not None:
                self.cache_hook.add_partial(RequestType.LOGLIKELIHOOD, request, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, counts = rolling_windows(self._encoder, [r.args[0] for r in requests])
        answers = self._executor.score(
            windows, self.max_length, RequestType.LOGLIKELIHOOD_ROLLING, disable_tqdm
        )
        totals: list[float] = []
        start = 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in answers[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial(RequestType.LOGLIKELIHOOD_ROLLING, request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts = Prompts(self._encoder, requests)  # lm-eval's tokenisation and decoding
        size = self._tunables.generate_part
        if len(requests) > size:  # tokenised, planned, decoded (by actors) in parts
            bounds = even_bounds(len(requests), size)
            texts = self._executor.generate_parts(
                len(requests),
                bounds,
                prompts.tokens(),
                prompts.settings(),
                disable_tqdm,
                prompts.decoding,
            )
        else:
            part = prompts.make(0, len(requests))
            texts = prompts.decode(self._executor.generate(part.requests, disable_tqdm, part.names))
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial(RequestType.GENERATE_UNTIL, request.args, text)
        return texts

    # ------------------------------------------------------------------------ internals
    def _start_group(
        self, model_args: dict[str, Any], obstacles: dict[ShardStrategy, list[str]], seed: int
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
            model_spec(self.pretrained, model_args, pad_token_id=self.tokenizer.pad_token_id),
            self._timeouts,
            seed=seed,
            strategy=parallelism.shard_strategy,
            obstacles=obstacles,
            shm_collectives=parallelism.shm_collectives,
            rank_class=self._tunables.rank_class,
        )
        self._executor.attach(group, reused=kept is not None)
        return group


def _engine_config(
    pretrained: str | None,
    config: EngineConfig | None,
    host: HostOptions | None,
    options: dict[str, Any],
) -> tuple[EngineConfig, HostOptions]:
    """The config and host of the keywords form, or those given.

    Raises:
        ConfigError: neither or both forms, or a bad keyword.
    """
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
        config = config_from_keywords(pretrained, **options)
    elif pretrained is not None or options:
        raise ConfigError("pass either a config or pretrained=... with keywords, not both")
    return config, host
