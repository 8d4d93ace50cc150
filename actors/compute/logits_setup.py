"""Which logits processors ``generate`` applies for a generate_until request, and whether the
continuous-batching engine (:mod:`rayeval.actors.compute.continuous`) reproduces each one row
by row.

``generate`` hands its processors the whole batch's input ids: lm-eval's left-padded contexts
and the tokens generated so far. A continuous-batching row reads its own tokens only (its
context, then what it generated), which gives ``generate``'s scores for these processors:

- ``RepetitionPenaltyLogitsProcessor``: ``generate`` leaves each row's left padding out of the
  penalty (``prompt_ignore_length`` from the attention mask, which lm-eval passes), so the
  penalised ids are the row's own tokens.
- ``NoRepeatNGramLogitsProcessor``: an n-gram that takes in padding can only ban a token when
  the row's last n-1 tokens hold the pad id. Where a context or an answer holds the pad id (a
  tokenizer whose pad is a token that also appears in text), lm-eval's own answer can depend on
  which requests its batch padded together; a row here never does.
- ``MinNewTokensLengthLogitsProcessor`` (``min_new_tokens``): ``generate`` counts the steps since
  the padded prompt, the same for every row, which is the row's generated tokens; it also turns
  ``min_length`` into ``min_new_tokens`` + the padded width, the same bound, so that
  ``MinLengthLogitsProcessor`` is left out.
- ``MinLengthLogitsProcessor`` alone (``min_length``): it counts the padded prompt, so lm-eval's
  own answer depends on the width of its batch: the static path runs, as for every processor
  not named here (and beam search).

Warpers (temperature, top-k, top-p, min-p) read the scores alone and run over all rows at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rayeval.actors.compute.generation import lm_eval_generation_kwargs

#: Warpers that read the scores alone (never the input ids), so rows can be processed together.
_ROW_WISE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
#: Processors that read the row's tokens (its context, then what it generated).
_READ_TOKENS = (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor)

#: Which ids a processor reads (:class:`Sampling`): none (the scores alone, all rows at once), the
#: row's tokens (its context, then what it generated), or only what it generated.
SCORES, TOKENS, GENERATED = "scores", "tokens", "generated"


@dataclass(frozen=True)
class Sampling:
    """The generation config ``generate`` would use for a group's settings, and its logits
    processors in ``generate``'s order, each with the ids it reads (:data:`SCORES`,
    :data:`TOKENS`, :data:`GENERATED`)."""

    config: GenerationConfig
    processors: tuple[tuple[Any, str], ...]

    @property
    def reads_ids(self) -> bool:
        """Whether some processor reads a row's ids (so rows keep their token history)."""
        return any(reads != SCORES for _, reads in self.processors)

    @property
    def eos(self) -> set[int]:
        """The ids that stop a row (``eos_token_id`` may be one id or a list)."""
        eos = self.config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def sampling_setup(model: Any, kwargs: dict[str, Any]) -> Sampling | str:
    """What ``generate`` would apply for ``kwargs`` on ``model`` (:class:`Sampling`), or why the
    continuous-batching engine cannot reproduce it (then the static path runs; see the module
    docstring).

    Uses transformers' own ``_prepare_generation_config``, ``_prepare_special_tokens`` and
    ``_get_logits_processor`` (private; see rayeval.service.private_apis), so every setting of
    the model's generation config (``generation_config.json``) applies as in ``generate``.
    """
    # The driver's shell is on the meta device, where the special tokens' checks cannot run.
    device = torch.device("cpu") if model.device.type == "meta" else model.device
    try:
        config, _ = model._prepare_generation_config(None, **lm_eval_generation_kwargs(kwargs))
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=device)
        processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=1, device=str(device)
        )
    except (AttributeError, TypeError, ValueError) as exc:
        return f"transformers' generation set-up changed ({type(exc).__name__}: {exc})"
    if (config.num_beams or 1) > 1:
        return "beam search"
    planned = _plan(config, processors, str(device))
    return planned if isinstance(planned, str) else Sampling(config, planned)


def _plan(config: GenerationConfig, processors: Any, device: str) -> tuple[Any, ...] | str:
    """Each processor with the ids it reads, or why one cannot run row by row."""
    planned: list[tuple[Any, str]] = []
    others: set[str] = set()
    for processor in processors:
        kind = type(processor)
        if isinstance(processor, _ROW_WISE):
            planned.append((processor, SCORES))
        elif kind in _READ_TOKENS:
            planned.append((processor, TOKENS))
        elif kind is MinNewTokensLengthLogitsProcessor:
            counted = MinNewTokensLengthLogitsProcessor(
                0, processor.min_new_tokens, processor.eos_token_id, device=device
            )
            planned.append((counted, GENERATED))
        elif kind is MinLengthLogitsProcessor and (config.min_new_tokens or 0) > 0:
            continue  # generate makes it min_new_tokens + the padded width: as the one above
        elif kind is MinLengthLogitsProcessor:
            return (
                "min_length (generate counts the left-padded prompt, so lm-eval's own answers "
                "depend on its batch)"
            )
        else:
            others.add(kind.__name__)
    if others:
        names = ", ".join(sorted(others))
        return f"logits processors continuous batching does not reproduce ({names})"
    return tuple(planned)
