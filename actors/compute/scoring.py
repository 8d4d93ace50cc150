"""Scoring on a rank: the log-likelihood of continuations, computed at their positions only.

Mirrors lm-eval's HF backend: right padding, log-softmax then gather, ``is_greedy`` when every
continuation token is the argmax. Plain rows run as lm-eval runs them (no attention mask); a
micro-batch with a packed row (a token tree, :mod:`rayeval.actors.compute.packing`) runs with a 4D
attention mask and position ids that give every token exactly its own request's view. The output
head runs only on the scored positions, and over them in chunks that a memory budget holds
(``--logits_budget_mib``): logits are positions x vocabulary, the largest activation of a forward
(DESIGN "Known pitfalls"; at a 152k vocabulary a 2,048-token rolling window's are 1.2 GB in
float32, and its log-probabilities as much again).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayeval.actors.batches import (
    DEFAULT_LOGITS_BUDGET_MIB,
    ScoreMicroBatch,
    ScoreResult,
    ScoreRow,
    StepStats,
    head_chunk_rows,
)
from rayeval.actors.compute.packing import packed_inputs, padded_ids
from rayeval.actors.compute.rank_model import RankModel, torch_dtype
from rayeval.actors.errors import ConfigError

#: Fewest rows a head chunk has (a smaller one is padded): MKL computes a float32 matmul of 1-3,
#: 5-7 and 9-11 rows with other kernels than one of 4, 8 or 12 and more, rounding otherwise (every
#: shape tried, AVX-512 and AVX2; bf16 is exact at every count). See Scorer._score_positions.
_SMALL_GEMM_ROWS = 12
DEFAULT_LOGITS_BUDGET = DEFAULT_LOGITS_BUDGET_MIB * 2**20


class Scorer:
    """Scores micro-batches with one rank's model.

    Args:
        rank: The rank's loaded model.
        logits_budget_bytes: Most bytes of logits and log-probabilities a micro-batch holds at
            once: its scored positions run through the output head in chunks of as many rows.
    """

    def __init__(self, rank: RankModel, logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET) -> None:
        self._rank = rank
        model = rank.model
        accepted = inspect.signature(model.forward).parameters
        # No KV cache when scoring: nothing reads it, and it holds 2 x layers x hidden floats per
        # token (for a 32-block model more than all other activations of the forward together).
        self._kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in accepted else {}
        self._keeps_logits = "logits_to_keep" in accepted
        self._budget = logits_budget_bytes
        self._trunk = _trunk(model)
        text = model.config.get_text_config()
        self._vocab = int(rank.spec.vocab_size or getattr(text, "vocab_size", 0) or 0)
        # Ranks that each score their own micro-batch but share the model's collectives (FSDP
        # at G > 1) run as many head chunks each: they agree on the count per micro-batch.
        self._synced = rank.shard_size > 1 and not rank.strategy.same_batch

    def score(self, batch: ScoreMicroBatch) -> tuple[ScoreResult, StepStats]:
        """Per row, per target: (sum of log-probs, whether every target token was greedy).

        A dummy micro-batch (no rows) scores one padding token, so that collectives line up.
        """
        started = time.monotonic()
        rank = self._rank
        rows = batch.rows or ()
        model_rows = rows or (ScoreRow((rank.spec.pad_token_id,), ()),)
        inputs, extra = self._inputs(model_rows)
        wanted = sorted(
            {(i, p) for i, row in enumerate(rows) for ps in row.scored_positions() for p in ps}
        ) or [(0, 0)]
        index = {pick: k for k, pick in enumerate(wanted)}
        targets = _Targets(rows, index, torch_dtype(rank.spec.softmax_dtype))
        self._score_positions(inputs.to(rank.device), wanted, extra, targets)
        real = sum(len(row.tokens) for row in rows)
        return targets.answers(), rank.step_stats(real, len(rows) * inputs.shape[1], started)

    def _score_positions(
        self,
        inputs: torch.Tensor,
        wanted: list[tuple[int, int]],
        extra: dict[str, torch.Tensor],
        targets: _Targets,
    ) -> None:
        """Runs the model once and its output head over ``wanted``'s positions (``(row,
        position)`` pairs, sorted) in chunks of at most the budget's rows, handing each chunk's
        logits to ``targets``. ``extra``: more forward arguments (mask, position ids).

        The first forward runs the whole model and keeps the trunk's output (the final hidden
        states); every further chunk runs the model's forward again with its trunk answering
        that output at once, so whatever the architecture does after the trunk (Gemma's logit
        soft-capping, Cohere's logit scale, an upcast) runs on every chunk as on the whole.
        A forward pre-hook on the output head hands it just the chunk's hidden states, padded
        to at least ``_SMALL_GEMM_ROWS`` rows: BLAS rounds a matmul of fewer rows differently,
        from there on every row has the bits of a head run on every position of the batch (as
        lm-eval's), and a row's log-softmax does not depend on the other rows of its chunk.
        """
        rank = self._rank
        width = inputs.shape[1]
        keep = width - min(position for _, position in wanted)
        count = len(wanted)
        head = rank.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Module):
            head = None
        step = self._chunk_rows(count) if head is not None else count
        chunks = -(-count // step)
        if self._synced and self._trunk is not None:
            agreed = torch.tensor([chunks], dtype=torch.int64, device=inputs.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            chunks = int(agreed.item())
        rows = torch.tensor([row for row, _ in wanted], device=inputs.device)
        positions = torch.tensor([position for _, position in wanted], device=inputs.device)
        trunk: list[Any] | None = [] if chunks > 1 else None  # the trunk's output, once given
        with rank.computing():
            for chunk in range(chunks):
                start = min(chunk * step, count)
                stop = min(start + step, count)
                dummy = start == stop  # a peer has more chunks: keep the collectives in step
                if dummy:
                    start, stop = 0, min(step, count)
                picks = (rows[start:stop], positions[start:stop])
                logits = self._forward(inputs, extra, keep, picks, head, trunk)
                if not dummy:
                    targets.take(start, logits)

    def _chunk_rows(self, count: int) -> int:
        """Scored positions per head chunk (:func:`head_chunk_rows`); all of them where they
        fit or the model's trunk cannot be found to run the head again."""
        if self._trunk is None or not self._vocab:
            return count
        return min(count, head_chunk_rows(self._vocab, self._budget))

    def _forward(
        self,
        inputs: torch.Tensor,
        extra: dict[str, torch.Tensor],
        keep: int,
        picks: tuple[torch.Tensor, torch.Tensor],
        head: torch.nn.Module | None,
        trunk: list[Any] | None,
    ) -> torch.Tensor:
        """The logits at ``picks`` (rows, positions), in that order: one forward of the model,
        its trunk's output replayed from ``trunk`` when that holds it (else kept there; None:
        neither)."""
        rows, positions = picks
        width = inputs.shape[1]
        count = len(rows)
        padding = max(0, _SMALL_GEMM_ROWS - count) if head is not None else 0
        rows = torch.cat([rows, rows[:1].expand(padding)])
        positions = torch.cat([positions, positions[:1].expand(padding)])
        picked = False

        def pick(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            nonlocal picked
            if picked or not args or not isinstance(args[0], torch.Tensor):
                return None  # called again or another way: leave it, pick afterwards
            hidden = args[0]  # (batch, kept positions, hidden): the last `keep` or all of them
            picked = True
            return (hidden[rows, positions - (width - hidden.shape[1])].unsqueeze(0), *args[1:])

        handles = [head.register_forward_pre_hook(pick)] if head is not None else []
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        try:
            with _trunk_output(self._trunk if trunk is not None else None, trunk, handles):
                logits = self._rank.model(inputs, **self._kwargs, **kwargs, **extra).logits
        finally:
            for handle in handles:
                handle.remove()
        if picked:
            return logits[0, :count]
        # A model whose forward does not call its output embeddings module: pick afterwards.
        return logits[rows[:count], positions[:count] - (width - logits.shape[1])]

    def _inputs(self, rows: tuple[ScoreRow, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Right-padded input ids, plus a mask and position ids when a row is packed."""
        pad = self._rank.spec.pad_token_id
        if any(row.parents is not None for row in rows):
            inputs, mask, position_ids = packed_inputs(rows, pad, self._additive_mask_dtype())
            device = self._rank.device
            return inputs, {
                "attention_mask": mask.to(device),
                "position_ids": position_ids.to(device),
            }
        return padded_ids(rows, pad), {}

    def _additive_mask_dtype(self) -> torch.dtype | None:
        """How this model takes a custom 4D mask: boolean (sdpa) or added to the scores (eager).

        Raises:
            ConfigError: an attention implementation that takes no custom mask.
        """
        model = self._rank.model
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation == "sdpa":
            return None
        if implementation == "eager":
            return model.dtype
        raise ConfigError(
            f"packed rows need sdpa or eager attention, this model runs {implementation!r}: "
            "run with --share_prefixes false, or load it with attn_implementation=sdpa"
        )


class _Targets:
    """Every target token of a micro-batch: the scored position that predicts it, then its
    log-prob and greedy check once that position's chunk of logits has run.

    Args:
        rows: The micro-batch's rows.
        index: (row, position) -> its place among the scored positions.
        softmax_dtype: The log-softmax's dtype (None: the logits').
    """

    def __init__(
        self,
        rows: tuple[ScoreRow, ...],
        index: dict[tuple[int, int], int],
        softmax_dtype: torch.dtype | None,
    ) -> None:
        picks: list[int] = []
        tokens: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # per target: its row, its tokens' span
        for i, row in enumerate(rows):
            for target, positions in zip(row.targets, row.scored_positions(), strict=True):
                first = len(picks)
                picks.extend(index[(i, p)] for p in positions)
                tokens.extend(target)
                self._spans.append((i, first, len(picks)))
        self._rows = len(rows)
        self._dtype = softmax_dtype
        # The tokens in the order of their positions, so a chunk's are one slice of them.
        self._order = sorted(range(len(picks)), key=picks.__getitem__)
        self._sorted = [picks[t] for t in self._order]
        self._picks, self._tokens = picks, tokens
        self._values: torch.Tensor | None = None
        self._greedy: torch.Tensor | None = None

    def take(self, first: int, logits: torch.Tensor) -> None:
        """The log-probs and greedy checks of the tokens scored at positions ``first`` on, from
        those positions' logits (one row each)."""
        lo = bisect_left(self._sorted, first)
        hi = bisect_left(self._sorted, first + len(logits))
        if lo == hi:
            return
        device = logits.device
        which = self._order[lo:hi]
        logprobs = F.log_softmax(logits, dim=-1, dtype=self._dtype)
        if self._values is None or self._greedy is None:
            self._values = torch.empty(len(self._picks), dtype=logprobs.dtype, device=device)
            self._greedy = torch.empty(len(self._picks), dtype=torch.bool, device=device)
        at = torch.tensor([self._picks[t] - first for t in which], device=device)
        tokens = torch.tensor([self._tokens[t] for t in which], device=device)
        slots = torch.tensor(which, device=device)
        self._values[slots] = logprobs[at, tokens]
        self._greedy[slots] = logprobs.argmax(dim=-1)[at] == tokens

    def answers(self) -> ScoreResult:
        """Per row, per target: (sum of log-probs, is_greedy), as lm-eval's HF backend reduces a
        target's gathered log-probs (one sum over them, in the log-softmax's dtype)."""
        results: ScoreResult = [[] for _ in range(self._rows)]
        if self._values is None or self._greedy is None:
            return results
        values = self._values
        ones = [first for _, first, stop in self._spans if stop - first == 1]
        sums = [values[first:stop].sum() for _, first, stop in self._spans if stop - first != 1]
        single = iter(values[torch.tensor(ones, device=values.device)].tolist() if ones else [])
        summed = iter(torch.stack(sums).tolist() if sums else [])
        greedy = self._greedy.tolist()
        for i, first, stop in self._spans:
            value = next(single) if stop - first == 1 else next(summed)
            results[i].append((value, all(greedy[first:stop])))
        return results


def _trunk(model: Any) -> torch.nn.Module | None:
    """The module whose output the head reads the final hidden states from (a causal LM's
    ``model``, GPT-2's ``transformer``), or None where there is none to find."""
    prefix = getattr(model, "base_model_prefix", "")
    trunk = getattr(model, prefix, None) if prefix else None
    return trunk if isinstance(trunk, torch.nn.Module) and trunk is not model else None


@contextlib.contextmanager
def _trunk_output(
    trunk: torch.nn.Module | None, kept: list[Any] | None, handles: list[Any]
) -> Iterator[None]:
    """Within the block, ``trunk`` answers ``kept``'s output at once when ``kept`` holds it; else
    its output is kept there (its hook's handle appended to ``handles``). None: neither."""
    if trunk is None or kept is None:
        yield
        return
    if not kept:
        handles.append(
            trunk.register_forward_hook(lambda _m, _a, out: None if kept else kept.append(out))
        )
        yield
        return
    own = trunk.__dict__.get("forward")  # an instance's own forward (a wrapper's), if any
    trunk.forward = lambda *args, **kwargs: kept[0]  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del trunk.forward
        else:
            trunk.forward = own  # type: ignore[method-assign]
