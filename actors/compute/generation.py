"""Generation on a rank: ``generate`` called exactly as lm-eval's HF backend calls it.

A micro-batch's contexts are left-padded into one batch and continued by one ``generate`` call
with lm-eval's own stopping criteria (its stop strings matched in decoded text) and generation
kwargs; when the replica has several ranks, ``synced_gpus`` keeps them stepping together.
"""

from __future__ import annotations

import time

import torch

from rayeval.actors.batches import GenerateMicroBatch, GenerateResult, StepStats
from rayeval.actors.compute.rank_model import RankModel


def generate(rank: RankModel, batch: GenerateMicroBatch) -> tuple[GenerateResult, StepStats]:
    """Greedy or sampled continuations of the micro-batch's contexts (generated ids only).

    A dummy micro-batch (no contexts) generates one token from one padding token, so that the
    ranks of a replica issue the same collectives.
    """
    from lm_eval.models.utils_hf import stop_sequences_criteria

    started = time.monotonic()
    pad = rank.spec.pad_token_id
    contexts = [list(c) for c in batch.contexts] or [[pad]]
    max_gen_toks = batch.max_gen_toks if batch.contexts else 1
    until = list(batch.until) if batch.contexts else []
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, ctx in enumerate(contexts):  # left padding, as lm-eval's tok_batch_encode
        input_ids[i, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        attention_mask[i, width - len(ctx) :] = 1
    with rank.computing():
        output = rank.model.generate(
            input_ids=input_ids.to(rank.device),
            attention_mask=attention_mask.to(rank.device),
            max_length=batch.max_length or width + max_gen_toks,
            stopping_criteria=stop_sequences_criteria(rank.tokenizer, until, width, len(contexts)),
            pad_token_id=pad,
            use_cache=True,
            # Ranks of one group stop together, or the slower ones hang at a collective (FSDP
            # ranks generate different rows; TP ranks the same, but a hang is never worth the
            # risk: one scalar all-reduce per step).
            synced_gpus=rank.shard_size > 1,
            **lm_eval_generation_kwargs(batch.kwargs),
        )
    generated = [row[width:] for row in output.tolist()] if batch.contexts else []
    # Prompt tokens plus generated ones (HF pads a sequence once it has finished).
    real = sum(len(c) for c in batch.contexts) + sum(
        sum(1 for token in row if token != pad) for row in generated
    )
    return generated, rank.step_stats(real, len(generated) * output.shape[1], started)


def lm_eval_generation_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """The generation kwargs as lm-eval's HF backend passes them to ``generate``: temperature 0
    (its default) means greedy, and greedy carries no temperature."""
    kwargs = dict(kwargs)
    kwargs["temperature"] = kwargs.get("temperature", 0.0)
    if kwargs["temperature"] == 0.0 and kwargs.get("do_sample") is None:
        kwargs["do_sample"] = False
    if kwargs.get("do_sample") is False and kwargs["temperature"] == 0.0:
        kwargs.pop("temperature")
    return kwargs
