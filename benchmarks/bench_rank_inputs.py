"""A rank's micro-batches in: rows as 32-bit buffers against rows as tuples of Python ints.

A score micro-batch travels pickled (``Replica.submit_many``, or bytes a planning actor made). Rows
now travel as 32-bit buffers (``ScoreRow.__reduce__``) and a rank builds its padded input ids
from them with one masked copy (``packing.padded_ids``). The reference, in the same run, is what
it replaced: rows pickled as tuples of ints (the dataclass's own pickling, forced here with
``reducer_override``) and one ``torch.tensor`` per row. Micro-batches are the product's own plans
(``plan_score``) at a token budget of ``--tokens``: MMLU-shaped questions as plain rows, and
questions behind one few-shot prefix as packed rows (``--share``). For each: the sender's pickling
(the driver's, where it planned), the rank's unpickling and its input ids, per micro-batch, the
inputs checked equal. The forward is not included.

    .venv/bin/python benchmarks/bench_rank_inputs.py --tokens 4000
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from collections.abc import Callable
from io import BytesIO
from typing import Any


def micro_batches(tokens: int, share: bool, count: int, seed: int = 0) -> list[Any]:
    """``count`` planned micro-batches of about ``tokens`` tokens: questions of 100-270 tokens
    with four one-token choices, behind one 400-token few-shot prefix with ``share``."""
    from rayeval.service.engine.plan.planner import TokenBudget, plan_score

    rng = random.Random(seed)
    prefix = [rng.randrange(100, 32_000) for _ in range(400 if share else 0)]
    pairs = []
    while sum(len(c) - len(prefix) for c, _ in pairs[::4]) < tokens * (count + 1):
        context = prefix + [rng.randrange(100, 32_000) for _ in range(rng.randint(100, 270))]
        pairs += [(context, [32 + choice]) for choice in range(4)]
    plan = plan_score(pairs, 4096, TokenBudget(max_tokens=tokens), share_prefixes=share)
    return plan.micro_batches[:count]


def as_tuples(batches: list[Any]) -> bytes:
    """The micro-batches pickled as before: every row's ids a tuple of Python ints."""
    from rayeval.actors.batches import ScoreRow

    class TuplePickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is ScoreRow:
                return ScoreRow, (obj.tokens, obj.targets, obj.parents, obj.positions)
            return NotImplemented

    out = BytesIO()
    TuplePickler(out, protocol=5).dump(batches)
    return out.getvalue()


def ids_one_by_one(rows: Any, pad: int) -> Any:
    """The input ids as a rank built them before: one tensor per row."""
    import torch

    width = max(len(row.tokens) for row in rows)
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        inputs[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
    return inputs


def per_batch_us(fn: Callable[[], Any], batches: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best / batches * 1e6


def compare(batches: list[Any], repeats: int) -> dict[str, tuple[float, float]]:
    """Per stage: (microseconds per micro-batch as tuples, as buffers)."""
    import torch

    from rayeval.actors.compute.packing import padded_ids

    n = len(batches)
    old, new = as_tuples(batches), pickle.dumps(batches, protocol=5)
    old_in, new_in = pickle.loads(old), pickle.loads(new)
    for before, after in zip(old_in, new_in, strict=True):
        assert torch.equal(ids_one_by_one(before.rows, 0), padded_ids(after.rows, 0))
    return {
        "pickle (sender)": (
            per_batch_us(lambda: as_tuples(batches), n, repeats),
            per_batch_us(lambda: pickle.dumps(batches, protocol=5), n, repeats),
        ),
        "unpickle (rank)": (
            per_batch_us(lambda: pickle.loads(old), n, repeats),
            per_batch_us(lambda: pickle.loads(new), n, repeats),
        ),
        "input ids (rank)": (
            per_batch_us(lambda: [ids_one_by_one(b.rows, 0) for b in old_in], n, repeats),
            per_batch_us(lambda: [padded_ids(b.rows, 0) for b in new_in], n, repeats),
        ),
        "bytes": (len(old) / n, len(new) / n),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000, help="micro-batch token budget")
    parser.add_argument("--batches", type=int, default=25, help="micro-batches (one call's)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for share in (False, True):
        batches = micro_batches(args.tokens, share, args.batches)
        rows = sum(len(b.rows) for b in batches) / len(batches)
        ids = sum(len(r.tokens) for b in batches for r in b.rows) / len(batches)
        kind = "packed rows (shared prefix)" if share else "plain rows"
        print(f"{kind}: {len(batches)} micro-batches of {rows:.1f} rows, {ids:,.0f} ids each")
        print(f"  {'per micro-batch':<18} {'tuples':>10} {'buffers':>10} {'ratio':>7}")
        for stage, (before, after) in compare(batches, args.repeats).items():
            unit = "B" if stage == "bytes" else "us"
            print(f"  {stage:<18} {before:>8,.1f}{unit:>2} {after:>8,.1f}{unit:>2} "
                  f"{before / after:>6.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
