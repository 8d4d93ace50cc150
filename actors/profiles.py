"""What rayeval knows of each model architecture, in one place (no torch).

A :class:`ModelShape` reads what the strategies and the planner ask of a model from its config —
a transformers ``PretrainedConfig`` on the driver, or a plain ``config.json`` mapping where the
service validates a request without transformers' config classes. A :class:`ModelProfile` is the
per-architecture knowledge that a config does not say:

- **packing**: whether the attention is plain causal attention over position ids whose custom 4D
  mask transformers passes through unchanged (``masking_utils._preprocess_mask_arguments``), so
  that packed rows (shared prefixes, :mod:`rayeval.actors.compute.packing`) score exactly;
- **vocabulary chunks**: whether the input embeddings are a plain lookup, so that a large
  vocabulary may be cut into FSDP row chunks (:mod:`rayeval.actors.parallel.vocab_chunks`): Gemma
  multiplies its embeddings by ``sqrt(hidden_size)`` in its embedding module, so its vocabulary
  stays whole;
- **decoder blocks**: the class names of the repeated blocks FSDP wraps one by one, where the
  model's own ``_no_split_modules`` does not name them (none known today);
- **continuous batching**: whether rayeval's continuous-batching engine
  (:mod:`rayeval.actors.compute.continuous`) was checked against ``generate`` for the architecture
  (its cache is transformers' plain dynamic cache, its forward takes position ids and a 2D mask);
- **tensor parallelism**: whether rayeval's exact rewrite of transformers' TP plan was checked
  against lm-eval hf for the architecture (the tests, or a ``1x2 tp`` cell of the conformance
  matrix exact in float32 and bf16: ``docs/conformance.md``). A plan alone is not enough: the
  matrix found one (HRM's, whose attention is gated) that ran and answered wrongly. Then the
  dimensions a TP plan splits over the ranks (each must be divisible by G); whether
  transformers has a plan for the architecture at all is the config class's
  ``base_model_tp_plan``.

A new architecture quirk is one :class:`ModelProfile` entry in :data:`PROFILES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelProfile:
    """What rayeval knows of one architecture (a transformers ``model_type``).

    Args:
        model_type: The architecture's ``model_type``.
        packable: Its attention takes a custom 4D mask and position ids and is plain causal
            attention (no sliding windows, sinks or ALiBi): packed rows score exactly.
        plain_embeddings: Its input embedding module is a plain lookup (no scaling): a large
            vocabulary may be cut into row chunks.
        continuous: The continuous-batching engine gives ``generate``'s tokens for it.
        tensor_parallel: Tensor parallelism (``tp``) was checked to give lm-eval hf's answers.
        block_classes: Class names of its decoder blocks, where ``_no_split_modules`` is missing.
    """

    model_type: str
    packable: bool = False
    plain_embeddings: bool = True
    continuous: bool = False
    tensor_parallel: bool = False
    block_classes: tuple[str, ...] = ()


#: Share of a GPU rank's free memory after loading that its KV cache may take: the rest holds a
#: prefill wave's activations and the allocator's slack.
KV_MEMORY_SHARE = 0.6

#: Every architecture rayeval knows something about; others get :class:`ModelProfile` defaults
#: (no packing; vocabulary chunks only where the modules are plain ``nn.Embedding``/``nn.Linear``).
PROFILES: dict[str, ModelProfile] = {
    profile.model_type: profile
    for profile in (
        ModelProfile("llama", packable=True, continuous=True, tensor_parallel=True),
        ModelProfile("mistral", packable=True, continuous=True),
        ModelProfile("qwen2", packable=True, continuous=True, tensor_parallel=True),
        ModelProfile("qwen3", packable=True, continuous=True),
        ModelProfile("gpt2", packable=True, continuous=True),
        ModelProfile("qwen3_moe", packable=True, continuous=True, tensor_parallel=True),
        ModelProfile("gpt_neox", tensor_parallel=True),
        ModelProfile("mixtral", tensor_parallel=True),
        ModelProfile("gemma", plain_embeddings=False),
        ModelProfile("gemma2", plain_embeddings=False),
        ModelProfile("gemma3_text", plain_embeddings=False),
    )
}

#: Attention implementations that apply an arbitrary 4D mask (``sdpa`` as a boolean mask,
#: ``eager`` added to the scores); flash attention takes none.
PACKABLE_ATTENTION = frozenset({"sdpa", "eager"})


class ModelShape:
    """A model's config as the strategies and the planner read it.

    Args:
        config: A transformers ``PretrainedConfig`` (its text config is used for multimodal
            models), or a ``config.json`` mapping.
    """

    def __init__(self, config: Any) -> None:
        if isinstance(config, Mapping):
            text = config.get("text_config")
            self._config: Any = _Attrs(text if isinstance(text, Mapping) else config)
            #: None: not known without transformers' config class (a config.json alone).
            self.has_tp_plan: bool | None = None
            self.tp_plan: dict[str, str] | None = None
        else:
            text = config.get_text_config() if hasattr(config, "get_text_config") else None
            self._config = text if text is not None else config
            #: The architecture's TP plan (pattern -> transformers style name).
            self.tp_plan = dict(getattr(self._config, "base_model_tp_plan", None) or {})
            self.has_tp_plan = bool(self.tp_plan)
        self.model_type = str(
            getattr(self._config, "model_type", None) or type(self._config).__name__
        )
        self.profile = PROFILES.get(self.model_type, ModelProfile(self.model_type))

    def attribute(self, name: str) -> Any:
        """A config attribute (None when absent, or when it differs by layer: transformers'
        per-layer configs, Gemma 4's ``head_dim``, raise ``AmbiguousGlobalPerLayerAttributeError``,
        a ``RuntimeError``, on a global read)."""
        try:
            return getattr(self._config, name, None)
        except RuntimeError:
            return None

    def tp_dimensions(self) -> dict[str, int]:
        """The dimensions a TP plan splits over the ranks, by their config names."""
        heads = self.attribute("num_attention_heads")
        kv_heads = self.attribute("num_key_value_heads")
        dims = {
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads if kv_heads is not None else heads,
            "intermediate_size": self.attribute("intermediate_size"),
        }
        return {name: value for name, value in dims.items() if isinstance(value, int)}

    @property
    def vocab_size(self) -> int:
        """Rows of the output head by the config (0 when it does not say)."""
        vocab = self.attribute("vocab_size")
        return vocab if isinstance(vocab, int) else 0

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of KV cache one token holds in the whole model (keys and values, every layer;
        0 when the config does not say)."""
        layers = self.attribute("num_hidden_layers") or self.attribute("n_layer") or 0
        heads = self.attribute("num_attention_heads") or self.attribute("n_head") or 0
        kv_heads = self.attribute("num_key_value_heads") or heads
        hidden = self.attribute("hidden_size") or self.attribute("n_embd") or 0
        head_dim = self.attribute("head_dim") or (hidden // heads if heads else 0)
        return int(2 * layers * kv_heads * head_dim * itemsize)

    def kv_capacity_tokens(self, free_bytes: int, itemsize: int, kv_shards: int) -> int | None:
        """The KV-cache positions :data:`KV_MEMORY_SHARE` of ``free_bytes`` holds on a rank that
        keeps 1/``kv_shards`` of every position's keys and values (tensor parallelism splits the
        heads), or None when the config does not say how big a position is."""
        per_token = self.kv_bytes_per_token(itemsize) / max(1, kv_shards)
        if per_token <= 0:
            return None
        return max(0, int(free_bytes * KV_MEMORY_SHARE // per_token))

    def packing_unsupported(self, attn_implementation: str | None) -> str | None:
        """Why packed rows cannot be scored exactly with this model, or None when they can.

        Args:
            attn_implementation: The attention implementation the ranks load the model with.
        """
        if not self.profile.packable:
            packable = sorted(t for t, p in PROFILES.items() if p.packable)
            return f"model type {self.model_type!r} is not one of {packable}"
        if attn_implementation not in PACKABLE_ATTENTION:
            return f"attention implementation {attn_implementation!r} takes no custom 4D mask"
        layer_types = self.attribute("layer_types") or ()
        if any(kind != "full_attention" for kind in layer_types):
            return "the model has sliding-window or other non-causal attention layers"
        if self.model_type == "mistral" and self.attribute("sliding_window") is not None:
            return "the model uses sliding-window attention"
        return None


class _Attrs:
    """Attribute access to a config.json mapping."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Any:
        return self._values.get(name)
