"""The vocabulary matrices of an FSDP-sharded model, cut into row chunks that are FSDP units.

Under FSDP a rank all-gathers one whole unit before computing it, and for a moment holds it twice
(the all-gather buffer and the unsharded parameter it is copied into). With a large vocabulary
the input embeddings and the output head are the largest units by far (a 32k x 1024 float32
matrix is 125 MiB, a decoder block of the same model ~26 MiB), so they, not the rank's 1/G,
set its peak. Here each becomes a few row chunks of about the largest decoder block's size,
each its own FSDP unit:

* the embedding gathers one chunk at a time and looks up that chunk's token ids in it (a copy of
  rows: exact), so it never holds more than a chunk;
* the head multiplies chunk by chunk (one chunk gathered at a time, its logits written into
  their columns) where that is bit-identical to one product with the whole weight. That is a
  property of the BLAS, so each rank checks it once for the head's shapes
  (:func:`chunked_products_are_exact`) and the replica's ranks agree on it. With MKL on an AVX2
  CPU, chunks of a multiple of 64 rows gave the whole product's values for every shape tried
  (624 of them: vocabularies of 3k-152k, hidden sizes of 64-2,048, 1 and 2 threads), while
  unaligned chunks did not.
  Where it is not exact, the head gathers one chunk at a time into one whole weight and
  multiplies once, holding the weight once (not twice) plus a chunk.

A tied head shares its chunks with the embeddings (one unit per chunk, gathered for each use).
Only exact ``nn.Embedding`` / bias-free ``nn.Linear`` modules are cut, and embeddings only where
the architecture's profile says they are a plain lookup (:mod:`rayeval.actors.profiles`: Gemma
scales its embeddings): others stay whole units. CPU ranks only for now
(:func:`rayeval.actors.model_loading.shard_model`): nothing here has run on a GPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rayeval.actors.profiles import ModelShape


class VocabRows(nn.Module):
    """Rows ``start:stop`` of a vocabulary matrix: looked up (embedding) or multiplied (head)."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        self.weight = nn.Parameter(weight[start:stop], requires_grad=weight.requires_grad)

    def forward(self, x: torch.Tensor, head: bool) -> torch.Tensor:
        return F.linear(x, self.weight) if head else F.embedding(x, self.weight)


class ChunkedEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are :class:`VocabRows` chunks; the same values, bit for bit."""

    def __init__(self, parts: Iterable[VocabRows], num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"token id out of range for an embedding of {self.num_embeddings} rows"
            )
        out: torch.Tensor | None = None
        for part in _rows(self.parts):  # every rank calls every chunk: each is a collective
            inside = (ids >= part.start) & (ids < part.stop)
            rows = part(ids[inside] - part.start, head=False)
            if out is None:
                out = rows.new_empty(*ids.shape, self.embedding_dim)
            out[inside] = rows
        assert out is not None
        return out


class ChunkedHead(nn.Module):
    """A bias-free ``nn.Linear`` output head whose rows are :class:`VocabRows` chunks."""

    def __init__(self, parts: Iterable[VocabRows], in_features: int, out_features: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = in_features, out_features
        # Multiply chunk by chunk: set where chunked_products_are_exact says so on every rank.
        self.by_chunks = False

    def products_by_chunk_are_exact(self) -> bool:
        """Whether this head's chunked products equal the whole one's on this machine."""
        first = _rows(self.parts)[0]
        return chunked_products_are_exact(
            self.in_features,
            self.out_features,
            first.stop - first.start,
            first.weight.dtype,
            first.weight.requires_grad,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The check ran in the parameters' dtype: under autocast (lm-eval's mixed_precision_dtype)
        # the products run in another, so the head multiplies once there.
        if self.by_chunks and not torch.is_autocast_enabled(hidden.device.type):
            logits: torch.Tensor | None = None
            for part in _rows(self.parts):  # each chunk gathered for its product, then freed
                piece = part(hidden, head=True)
                if logits is None:
                    logits = piece.new_empty(*piece.shape[:-1], self.out_features)
                logits[..., part.start : part.stop] = piece
            assert logits is not None
            return logits
        # The whole weight, assembled chunk by chunk, then one matmul: bit-identical to the
        # uncut head's logits wherever chunked products are not.
        weight: torch.Tensor | None = None
        for part in _rows(self.parts):
            if isinstance(part, FSDPModule):
                part.unshard()
            try:
                if weight is None:
                    weight = part.weight.new_empty(self.out_features, self.in_features)
                weight[part.start : part.stop].copy_(part.weight)
            finally:
                if isinstance(part, FSDPModule):
                    part.reshard()
        assert weight is not None
        # As the uncut parameter: torch's matmul takes another (differently rounded) path for a
        # non-contiguous 3-D input when the weight requires grad, even under no_grad.
        weight.requires_grad_(_rows(self.parts)[0].weight.requires_grad)
        return F.linear(hidden, weight)


# (rows, positions, kept positions) of the head inputs checked: one decode step of 1-3 and 16
# rows, the last position(s) of prompts (a non-contiguous slice), scored positions picked into
# one row. MKL picks its kernel by the rows per product (1, 2-3, 4 and more).
_CHECKED_SHAPES = (
    (1, 1, 1),
    (2, 1, 1),
    (3, 1, 1),
    (16, 1, 1),
    (1, 5, 1),
    (2, 9, 1),
    (3, 7, 2),
    (1, 20, 3),
    (4, 30, 1),
    (5, 10, 4),
    (1, 64, 64),
    (1, 200, 200),
)


@functools.lru_cache(maxsize=16)
def chunked_products_are_exact(
    in_features: int, out_features: int, step: int, dtype: torch.dtype, requires_grad: bool
) -> bool:
    """Whether a head of this shape gives bit-identical logits multiplied by ``step``-row chunks.

    Checked on this process's CPU, with its thread count, on random values of the head's own
    shape and dtype (``requires_grad`` as the parameters: torch's matmul takes another path for
    a non-contiguous input when the weight requires grad) for the input shapes a worker feeds
    its head (:data:`_CHECKED_SHAPES`). Holds one random matrix of the head's size for the check.
    """
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(out_features, in_features, generator=generator).to(dtype)
    chunks = [
        whole[start : start + step].requires_grad_(requires_grad)
        for start in range(0, out_features, step)
    ]
    whole.requires_grad_(requires_grad)
    with torch.no_grad():
        for rows, positions, kept in _CHECKED_SHAPES:
            hidden = torch.randn(rows, positions, in_features, generator=generator).to(dtype)
            hidden = hidden[:, positions - kept :]
            expected = F.linear(hidden, whole)
            got = torch.cat([F.linear(hidden, chunk) for chunk in chunks], dim=-1)
            if not torch.equal(expected, got):
                return False
    return True


def _rows(parts: nn.ModuleList) -> list[VocabRows]:
    return [cast(VocabRows, part) for part in parts]


def split_vocabulary(model: nn.Module, largest_unit: int) -> dict[int, tuple[nn.Parameter, int]]:
    """Cut the model's embeddings and head into chunks of about ``largest_unit`` elements.

    Args:
        model: A causal LM on any device (meta included), not yet sharded.
        largest_unit: Elements of the largest other FSDP unit (a decoder block).

    Returns:
        For each new chunk parameter (by ``id``): the parameter it was cut from and its first
        row, so that a loader reads its rows of the checkpoint tensor. Empty when nothing was
        cut (small vocabulary, or modules of another kind).
    """
    try:
        embed = model.get_input_embeddings()  # type: ignore[operator]
        head = model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return {}
    tied = isinstance(embed, nn.Module) and getattr(head, "weight", None) is getattr(
        embed, "weight", False
    )
    config = getattr(model, "config", None)
    plain = config is None or ModelShape(config).profile.plain_embeddings
    if not plain or type(embed) is not nn.Embedding or embed.max_norm is not None:
        embed = None
    if type(head) is not nn.Linear or head.bias is not None:
        head = None
    if tied and (embed is None or head is None):
        return {}  # one tensor: cut both uses or neither
    origins: dict[int, tuple[nn.Parameter, int]] = {}
    chunks: dict[int, list[VocabRows]] = {}  # weight id -> its chunks (shared when tied)

    def chunked(weight: nn.Parameter) -> list[VocabRows] | None:
        if id(weight) not in chunks:
            rows = weight.shape[0]
            count = math.ceil(weight.numel() / max(largest_unit, 1))
            if count <= 1:
                return None
            # Rows per chunk rounded up to a multiple of 64: chunk boundaries on the column
            # blocks of the BLAS kernels, where chunked head products can be exact (unaligned
            # ones were not: chunked_products_are_exact).
            step = math.ceil(math.ceil(rows / count) / 64) * 64
            parts = [VocabRows(weight, a, min(a + step, rows)) for a in range(0, rows, step)]
            for part in parts:
                origins[id(part.weight)] = (weight, part.start)
            chunks[id(weight)] = parts
        return chunks[id(weight)]

    if embed is not None and (parts := chunked(embed.weight)) is not None:
        model.set_input_embeddings(ChunkedEmbedding(parts, *embed.weight.shape))  # type: ignore[operator]
    if head is not None and (parts := chunked(head.weight)) is not None:
        model.set_output_embeddings(ChunkedHead(parts, head.in_features, head.out_features))  # type: ignore[operator]
    return origins


def vocabulary_units(model: nn.Module) -> list[VocabRows]:
    """The chunk modules :func:`split_vocabulary` made, each once (a tied chunk serves both)."""
    seen: dict[int, VocabRows] = {}
    for module in model.modules():
        if isinstance(module, VocabRows):
            seen.setdefault(id(module), module)
    return list(seen.values())
