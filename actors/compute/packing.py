"""Model inputs for packed score rows: token trees fed once, each token seeing only its ancestors.

A packed :class:`rayeval.actors.batches.ScoreRow` holds the inputs of several requests that share a
prefix, the shared tokens once (the planner builds it:
``rayeval.service.engine.plan.planner.pack_prefixes``). Scoring it exactly as lm-eval scores each
request on a row of its own takes two things the model
already accepts:

- a custom 4D attention mask in which token ``i`` attends to itself and its ancestors only (never
  to a sibling branch: the other choices of the same question), and
- position ids equal to each token's depth in the tree, i.e. its position in its own request's
  input, so rotary (Llama, Qwen2) and learned (GPT-2) positions are the ones lm-eval uses.

Then each token's hidden states are those of the same token in the unpacked input; only the order
of floating-point sums inside attention changes (fp32: far below lm-eval's 1e-4 tolerance). In
bf16 and fp16 that order is enough to move a bit (attention rounds by the width it runs over), so
the driver packs float32 models only
(``rayeval.service.engine.plan.model_shell.packing_supported``).

transformers passes a 4D mask through unchanged (``masking_utils._preprocess_mask_arguments``);
``sdpa`` takes it as a boolean mask, ``eager`` adds it to the scores, so it gets 0 / -inf-like
floats. Other attention implementations (flash attention: no arbitrary masks) and models whose
masks are not plain causal (sliding windows, attention sinks, ALiBi) are not packed: the driver
asks the model's profile (``rayeval.actors.profiles.ModelShape.packing_unsupported``) before it
plans, and those models use plain rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from rayeval.actors.batches import ScoreRow


def packed_inputs(
    rows: Sequence[ScoreRow], pad_token_id: int, additive_mask_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, a 4D attention mask and position ids for rows of any kind.

    Args:
        rows: Plain and packed rows of one micro-batch.
        pad_token_id: Token id of the padding.
        additive_mask_dtype: None for a boolean mask (True: attend; ``sdpa``); a float dtype for
            an additive mask (0 or that dtype's minimum; ``eager``).

    Returns:
        ``input_ids`` (B, W), ``attention_mask`` (B, 1, W, W), ``position_ids`` (B, W). A padding
        position attends to itself only, so no softmax row is empty; nothing reads its output.
    """
    input_ids = padded_ids(rows, pad_token_id)
    width = input_ids.shape[1]
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1)
    for i, row in enumerate(rows):
        n = len(row.tokens)
        if row.parents is None:
            position_ids[i, :n] = torch.arange(n)
            allowed[i, :n, :n] = torch.ones((n, n), dtype=torch.bool).tril()
        else:
            depth, ancestors = _tree(row.parents)
            position_ids[i, :n] = depth
            allowed[i, :n, :n] = ancestors
    mask = allowed.unsqueeze(1)
    if additive_mask_dtype is not None:
        blocked = torch.finfo(additive_mask_dtype).min
        mask = torch.zeros(mask.shape, dtype=additive_mask_dtype).masked_fill(~mask, blocked)
    return input_ids, mask, position_ids


def padded_ids(rows: Sequence[ScoreRow], pad_token_id: int) -> torch.Tensor:
    """The rows' token ids right-padded to the longest (rows x width, int64).

    Rows a rank received hold their ids in 32-bit buffers (``ScoreRow.__reduce__``): those are
    joined and placed with one masked copy, not converted int by int row by row.
    """
    width = max((len(row.tokens) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    buffers = [r.tokens for r in rows if isinstance(r.tokens, array) and r.tokens.typecode == "i"]
    if len(buffers) < len(rows):  # rows made in this process: tuples
        for i, row in enumerate(rows):
            ids[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
        return ids
    flat = array("i")
    for buffer in buffers:
        flat += buffer
    if flat:
        lengths = torch.tensor([len(row.tokens) for row in rows])
        filled = torch.arange(width) < lengths.unsqueeze(1)
        ids[filled] = torch.frombuffer(flat, dtype=torch.int32).long()
    return ids


def _tree(parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's depth, and which tokens it sees (itself and its ancestors), from parents.

    Raises:
        ValueError: a parent that does not come before its child (not a tree in row order).
    """
    n = len(parents)
    depth = torch.zeros(n, dtype=torch.long)
    ancestors = torch.zeros((n, n), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"token {i}'s parent {parent} does not come before it")
        if parent >= 0:
            ancestors[i] = ancestors[parent]
            depth[i] = depth[parent] + 1
        ancestors[i, i] = True
    return depth, ancestors
