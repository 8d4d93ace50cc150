"""Which of ``generate``'s logits processors continuous batching runs, and that running them row
by row on each row's own tokens gives ``generate``'s scores over a left-padded batch
(actors/compute/logits_setup.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from rayeval.actors.compute.logits_setup import GENERATED, SCORES, TOKENS, Sampling, sampling_setup

pytestmark = pytest.mark.unit

BOS, EOS, PAD, VOCAB = 0, 1, 2, 64
GREEDY = {"until": ["\n"], "do_sample": False}


def _model(root: Path, meta: bool, **generation: Any) -> Any:
    """A tiny Llama saved under ``root`` with ``generation`` in its generation_config.json, as
    the driver's shell (meta) or as a rank builds it (random weights)."""
    from rayeval.service.engine.plan.encoder import meta_model

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD,
    )  # fmt: skip
    config.save_pretrained(root)
    special = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    transformers.GenerationConfig(**{**special, **generation}).save_pretrained(root)
    if meta:
        return meta_model(str(root), {})[0]
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig.from_pretrained(root)
    return model


def _reads(setup: Sampling | str) -> list[tuple[str, str]]:
    assert isinstance(setup, Sampling), setup
    return [(type(p).__name__, reads) for p, reads in setup.processors]


def test_the_shell_reads_the_files_settings(tmp_path: Path) -> None:
    shell = _model(
        tmp_path, True, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=2,
        min_length=5, eos_token_id=[EOS, 7],
    )  # fmt: skip
    setup = sampling_setup(shell, GREEDY)
    assert _reads(setup) == [
        ("RepetitionPenaltyLogitsProcessor", TOKENS),
        ("NoRepeatNGramLogitsProcessor", TOKENS),
        ("MinNewTokensLengthLogitsProcessor", GENERATED),  # min_length: generate overrides it
    ]
    assert isinstance(setup, Sampling) and setup.eos == {EOS, 7}
    sampled = sampling_setup(shell, {**GREEDY, "do_sample": True, "temperature": 0.7, "top_k": 5})
    assert [reads for _, reads in _reads(sampled)][-2:] == [SCORES, SCORES]


@pytest.mark.parametrize(
    ("generation", "reason"),
    [
        ({"min_length": 5}, "min_length"),
        ({"num_beams": 2}, "beam search"),
        ({"bad_words_ids": [[5, 6]]}, "NoBadWordsLogitsProcessor"),
    ],
)
def test_what_it_cannot_reproduce_is_named(
    tmp_path: Path, generation: dict[str, Any], reason: str
) -> None:
    setup = sampling_setup(_model(tmp_path, True, **generation), GREEDY)
    assert isinstance(setup, str) and reason in setup


def test_row_by_row_equals_generates_scores_over_a_padded_batch(tmp_path: Path) -> None:
    """Each row's own tokens (no pad id among them) against ``generate``'s processors over the
    left-padded batch, with the attention mask lm-eval passes, at every step of a decode."""
    model = _model(
        tmp_path, False, repetition_penalty=1.7, no_repeat_ngram_size=2, min_new_tokens=3,
        eos_token_id=[EOS, 7],
    )  # fmt: skip
    setup = sampling_setup(model, GREEDY)
    assert isinstance(setup, Sampling)
    generator = torch.Generator().manual_seed(0)
    contexts = [[3, 9, 7, 12, 30, 9], [11, 11], [40, 41, 42, 43]]  # row 0: 7, 12 banned
    width = max(map(len, contexts))
    ids = torch.tensor([[PAD] * (width - len(c)) + c for c in contexts])
    mask = torch.arange(width)[None] >= torch.tensor([width - len(c) for c in contexts])[:, None]
    config, _ = model._prepare_generation_config(None, do_sample=False)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    config.min_length = config.min_new_tokens + width  # as generate sets it
    batched = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=width, device="cpu",
        model_kwargs={"attention_mask": mask.long()},
    )  # fmt: skip
    generated: list[list[int]] = [[] for _ in contexts]
    for _ in range(6):
        scores = torch.randn((len(contexts), VOCAB), generator=generator)
        expected = batched(ids, scores.clone())
        rows = []
        for i, context in enumerate(contexts):
            row = scores[i : i + 1].clone()
            for processor, reads in setup.processors:
                row_ids = generated[i] if reads == GENERATED else context + generated[i]
                row = processor(torch.tensor([row_ids], dtype=torch.long), row)
            rows.append(row)
        assert torch.equal(torch.cat(rows), expected)
        assert not torch.equal(expected, scores)
        tokens = expected.argmax(dim=-1)
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        for i, token in enumerate(tokens.tolist()):
            generated[i].append(token)
