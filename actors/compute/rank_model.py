"""A rank's loaded model and what every computation on it shares.

:class:`RankModel` is what scoring (:mod:`rayeval.actors.compute.scoring`) and generation
(:mod:`rayeval.actors.compute.generation`) compute with: the model as the replica's strategy loaded
it, the device, the tokenizer, and :meth:`RankModel.computing`, the one context every forward and
``generate`` runs in (no gradients, lm-eval's autocast dtype, and the strategy's clean-up after
it, even when it raised).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rayeval.actors.batches import ModelSpec, StepStats
from rayeval.actors.parallel.sharding import ShardingStrategy
from rayeval.actors.process import rss_mib


@dataclass
class RankModel:
    """One rank's part of the model and how to compute with it.

    Args:
        model: The model as the strategy loaded it (eval mode).
        spec: How it was loaded (pad id, softmax and autocast dtypes).
        device: This rank's torch device.
        strategy: The replica's sharding strategy.
        shard_size: G.
        tokenizer: The model's tokenizer (stop strings are matched in decoded text).
    """

    model: Any
    spec: ModelSpec
    device: torch.device
    strategy: ShardingStrategy
    shard_size: int
    tokenizer: Any

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """No gradients, lm-eval's ``mixed_precision_dtype`` autocast, and the strategy's
        ``after_forward`` when the block ends (FSDP: every unit back to its shard)."""
        dtype = torch_dtype(self.spec.mixed_precision_dtype)
        autocast = torch.autocast(
            device_type=self.device.type, dtype=dtype, enabled=dtype is not None
        )
        try:
            with torch.no_grad(), autocast:
                yield
        finally:
            self.strategy.after_forward(self.model)

    def step_stats(self, real: int, padded: int, started: float) -> StepStats:
        """A micro-batch's figures, with this rank's memory as it stands after it."""
        device_mib = 0.0
        if self.device.type == "cuda":
            device_mib = torch.cuda.memory_allocated(self.device) / 2**20
        return StepStats(
            real, padded, time.monotonic() - started, rss_mib=rss_mib(), device_mib=device_mib
        )


def torch_dtype(name: str | None) -> torch.dtype | None:
    """A torch dtype by name (None stays None)."""
    return None if name is None else getattr(torch, name)
