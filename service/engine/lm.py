"""``RayEvalLM``: an lm-eval ``LM`` whose requests run on Ray replicas of a sharded model.

lm-eval builds every request once, on the driver, and hands them to this class by request type.
This class is lm-eval's adapter only: it takes lm-eval's ``Instance`` objects, hands them to an
:class:`~rayeval.service.engine.engine.Engine` (which owns the replicas and runs each request type)
and records each answer in lm-eval's cache hook. Tokenisation is lm-eval's own HF backend's, by an
``HFLM`` built over a weightless (meta-device) copy of the model
(:mod:`rayeval.service.engine.plan.encoder`), so every tokenizer rule (BOS handling, pad token,
chat templates, max length) is lm-eval's own code. Only the forward passes leave the driver.

Usage from Python, one line changed from a plain lm-eval script::

    with RayEvalLM(pretrained="meta-llama/Llama-3.1-8B", num_replicas=4, shard_size=2) as lm:
        results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])
        figures = lm.engine.stats  # per request type; lm.engine.swap_checkpoint(path) etc.

or by name: ``simple_evaluate(model="rayeval", model_args="pretrained=...,num_replicas=4")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from rayeval.actors.errors import ConfigError, RayEvalError
from rayeval.service.engine.dispatch.warm import KeptReplicas
from rayeval.service.engine.engine import Engine
from rayeval.service.engine.parts.pipeline import Tunables
from rayeval.service.engine.plan.checks import Origins
from rayeval.service.vocabulary.config import EngineConfig, HostOptions
from rayeval.service.vocabulary.config_fields import config_from_keywords
from rayeval.service.vocabulary.doors import Door, reword
from rayeval.service.vocabulary.events import OnWarning, Progress, RequestType, Stage


@register_model("rayeval")
class RayEvalLM(TemplateLM):
    """Evaluate a Hugging Face causal LM on R x G Ray actors with results identical to lm-eval's HF.

    Built from an :class:`EngineConfig` (what ``rayeval run`` and the service do, through
    :meth:`from_config`), or from keywords, as lm-eval builds a model by name
    (``model_args="pretrained=...,num_replicas=4"``) and as a Python user writes it. The engine
    it drives is :attr:`engine` (figures, where the ranks run, checkpoint swaps).

    Args:
        pretrained: Hub id or local path, as lm-eval's ``pretrained=`` (keywords form).
        config: The engine's configuration (instead of ``pretrained`` and ``options``).
        host: Where it runs: the Ray address and the actors' name prefix.
        on_progress, on_warning, replicas, tunables, on_stage, settings: as :class:`Engine`
            takes them.
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
        on_warning: OnWarning | None = None,
        replicas: KeptReplicas | None = None,
        tunables: Tunables | None = None,
        on_stage: Callable[[Stage], None] | None = None,
        settings: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        keywords = config is None  # the fields an error names are keywords too
        try:
            config, host = _engine_config(pretrained, config, host, options)
            self.engine = Engine(
                config, host, on_progress, on_warning, replicas, tunables, on_stage, settings
            )
        except RayEvalError as exc:
            if keywords:
                reword(exc, Door.PYTHON)
            raise
        self.batch_sizes: dict[int, int] = {}
        self.pretrained = config.pretrained
        self.tokenizer = self.engine.encoder.tokenizer

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        host: HostOptions | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_warning: OnWarning | None = None,
        replicas: KeptReplicas | None = None,
        on_stage: Callable[[Stage], None] | None = None,
        settings: str | None = None,
    ) -> RayEvalLM:
        """The engine for ``config`` (an :class:`EvaluationConfig` is one), started on ``host``."""
        return cls(
            config=config,
            host=host,
            on_progress=on_progress,
            on_warning=on_warning,
            replicas=replicas,
            on_stage=on_stage,
            settings=settings,
        )

    def close(self, keep: bool = False) -> None:
        """Release the replicas (``keep``: into the kept replicas given, if they keep them)."""
        self.engine.close(keep)

    def __enter__(self) -> RayEvalLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(keep=exc_type is None)

    # ------------------------------------------------------- tokenisation (lm-eval's own)
    @property
    def eot_token_id(self) -> int:
        return self.engine.encoder.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.engine.encoder.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.engine.encoder.max_length

    @property
    def max_gen_toks(self) -> int:
        return self.engine.encoder.max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.engine.encoder.tokenizer_name

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.engine.encoder.tok_encode(string, **kwargs)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.engine.encoder.apply_chat_template(chat_history, add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval's HF backend records about the model, plus the layout."""
        return self.engine.model_info()

    # -------------------------------------------------------------------- request types
    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        pairs = [r.args for r in requests]
        answers = self.engine.loglikelihood(pairs, Origins(requests), disable_tqdm)
        return self._hooked(pairs, answers)

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score lm-eval's tokenised requests, ``((context, continuation), ctx_enc,
        cont_enc)`` (lm-eval's ``TemplateLM`` calls it)."""
        answers = self.engine.loglikelihood_tokens(requests, disable_tqdm)
        return self._hooked([request[0] for request in requests], answers)

    def _hooked(self, requests: list[Any], answers: list[Any]) -> list[Any]:
        """lm-eval's cache hook given each (context, continuation) request's answer."""
        for request, answer in zip(requests, answers, strict=True):
            if request is not None:
                self.cache_hook.add_partial(RequestType.LOGLIKELIHOOD, request, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        totals = self.engine.loglikelihood_rolling([r.args[0] for r in requests], disable_tqdm)
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial(RequestType.LOGLIKELIHOOD_ROLLING, request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        texts = self.engine.generate_until(requests, disable_tqdm)
        for request, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial(RequestType.GENERATE_UNTIL, request.args, text)
        return texts


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
