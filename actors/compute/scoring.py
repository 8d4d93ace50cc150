"""Scoring on a rank: the log-likelihood of continuations, computed at their positions only.

Mirrors lm-eval's HF backend: right padding, log-softmax then gather, ``is_greedy`` when every
continuation token is the argmax. Plain rows run as lm-eval runs them (no attention mask); a
micro-batch with a packed row (a token tree, :mod:`rayeval.actors.compute.packing`) runs with a 4D
attention mask and position ids that give every token exactly its own request's view. The output
head runs only on the scored positions: logits are batch x positions x vocabulary, the largest
activation of a forward (DESIGN "Known pitfalls").
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
import torch.nn.functional as F

from rayeval.actors.batches import ScoreMicroBatch, ScoreResult, ScoreRow, StepStats
from rayeval.actors.compute.packing import packed_inputs, padded_ids
from rayeval.actors.compute.rank_model import RankModel, torch_dtype
from rayeval.actors.errors import ConfigError

#: Below this many rows a CPU matmul rounds differently (see Scorer._scored_logits).
_SMALL_GEMM_ROWS = 4


class Scorer:
    """Scores micro-batches with one rank's model.

    Args:
        rank: The rank's loaded model.
    """

    def __init__(self, rank: RankModel) -> None:
        self._rank = rank
        accepted = inspect.signature(rank.model.forward).parameters
        # No KV cache when scoring: nothing reads it, and it holds 2 x layers x hidden floats per
        # token (for a 32-block model more than all other activations of the forward together).
        self._kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in accepted else {}
        self._keeps_logits = "logits_to_keep" in accepted

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
        logits = self._scored_logits(inputs.to(rank.device), wanted, extra)
        results = self._answers(rows, logits, index)
        real = sum(len(row.tokens) for row in rows)
        return results, rank.step_stats(real, len(rows) * inputs.shape[1], started)

    def _answers(
        self, rows: tuple[ScoreRow, ...], logits: torch.Tensor, index: dict[tuple[int, int], int]
    ) -> ScoreResult:
        """Per row, per target: (sum of log-probs, is_greedy), from the scored positions' logits
        (``index``: (row, position) -> its row of ``logits``).

        One-token targets (a multiple-choice letter) share one log-softmax, argmax and gather
        over their positions and one copy to the host, not a dozen small kernels and two device
        syncs each: a log-softmax and an argmax are computed position by position (lm-eval's
        whole-batch call gives each the same values) and such a target's sum is its one value.
        Longer targets are computed one by one as lm-eval reduces them (and as many positions'
        log-probs are never held at once).
        """
        softmax_dtype = torch_dtype(self._rank.spec.softmax_dtype)
        places = [
            (i, [index[(i, p)] for p in positions], target)
            for i, row in enumerate(rows)
            for target, positions in zip(row.targets, row.scored_positions(), strict=True)
        ]
        single = [(ks[0], target[0]) for _, ks, target in places if len(target) == 1]
        shared = sorted({k for k, _ in single})
        at = {k: j for j, k in enumerate(shared)}
        answers: list[tuple[float, bool]] = []
        if single:
            device = logits.device
            picks = torch.tensor(shared, dtype=torch.long).to(device)
            logprobs = F.log_softmax(logits[picks], dim=-1, dtype=softmax_dtype)
            rows_of = torch.tensor([at[k] for k, _ in single], dtype=torch.long).to(device)
            ids = torch.tensor([t for _, t in single], dtype=torch.long).to(device)
            values = logprobs[rows_of, ids].tolist()
            greedy = (logprobs.argmax(dim=-1)[rows_of] == ids).tolist()
            answers = list(zip(values, greedy, strict=True))
        ones = iter(answers)
        results: ScoreResult = [[] for _ in rows]
        for i, ks, target in places:
            one = len(target) == 1
            results[i].append(next(ones) if one else _answer(logits, ks, target, softmax_dtype))
        return results

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

    def _scored_logits(
        self,
        inputs: torch.Tensor,
        wanted: list[tuple[int, int]],
        extra: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Logits at each ``(row, position)`` of ``wanted``, in that order: shape
        (len(wanted), vocabulary). ``extra``: more forward arguments (mask, position ids).

        A forward pre-hook on the output head hands it just the scored positions' hidden states.
        BLAS rounds a matmul with fewer rows differently (MKL on x86: 1, 2-3 and 4+ rows per
        matrix are three kernels): with fewer than ``_SMALL_GEMM_ROWS`` kept positions the head
        runs on them all (at most 3 per row), from there on on the scored positions only, padded
        to at least ``_SMALL_GEMM_ROWS`` rows; either way every log-prob has the bits of a head
        run on every row's last positions.
        """
        rank = self._rank
        width = inputs.shape[1]
        keep = width - min(position for _, position in wanted)
        rows = torch.tensor([row for row, _ in wanted])
        positions = torch.tensor([position for _, position in wanted])
        count = len(wanted)
        select = keep >= _SMALL_GEMM_ROWS
        padding = max(0, _SMALL_GEMM_ROWS - count) if select else 0
        rows = torch.cat([rows, rows[:1].expand(padding)]).to(inputs.device)
        positions = torch.cat([positions, positions[:1].expand(padding)]).to(inputs.device)
        head = rank.model.get_output_embeddings() if select else None
        picked = False

        def pick(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            nonlocal picked
            if picked or not args or not isinstance(args[0], torch.Tensor):
                return None  # called again or another way: leave it, pick afterwards
            hidden = args[0]  # (batch, kept positions, hidden): the last `keep` or all of them
            picked = True
            return (hidden[rows, positions - (width - hidden.shape[1])].unsqueeze(0), *args[1:])

        handle = head.register_forward_pre_hook(pick) if isinstance(head, torch.nn.Module) else None
        try:
            with rank.computing():
                kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
                logits = rank.model(inputs, **self._kwargs, **kwargs, **extra).logits
        finally:
            if handle is not None:
                handle.remove()
        if picked:
            return logits[0, :count]
        # A model whose forward does not call its output embeddings module: pick afterwards.
        return logits[rows[:count], positions[:count] - (width - logits.shape[1])]

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


def _answer(
    logits: torch.Tensor, picks: list[int], target: tuple[int, ...], dtype: torch.dtype | None
) -> tuple[float, bool]:
    """One target's (sum of log-probs, is_greedy), as lm-eval's HF backend computes it."""
    device = logits.device
    logprobs = F.log_softmax(logits[torch.tensor(picks, device=device)], dim=-1, dtype=dtype)
    target_ids = torch.tensor(target, dtype=torch.long, device=device)
    is_greedy = bool((logprobs.argmax(dim=-1) == target_ids).all())
    return float(logprobs.gather(1, target_ids.unsqueeze(-1)).sum()), is_greedy
