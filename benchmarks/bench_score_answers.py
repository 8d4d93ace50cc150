"""A rank's answers from its scored logits: one-token targets together, against one by one.

``Scorer._answers`` computes the one-token targets of a micro-batch (multiple-choice letters) with
one log-softmax, argmax and gather over their distinct positions; the reference is the per-target
path it replaced (``scoring._answer``, still used for longer targets: a log-softmax, argmax,
gather and sum per target, two host syncs each). Both run on the same random logits of an
MMLU-shaped micro-batch (``--rows`` questions, four one-token choices scored at each question's
last position); the answers are checked equal, then each is timed (model forward excluded).

    .venv/bin/python benchmarks/bench_score_answers.py --vocab 128256 --rows 21
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable
from typing import Any


def main() -> int:
    import torch

    from rayeval.actors.batches import ScoreRow
    from rayeval.actors.compute.scoring import Scorer, _answer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128_256, help="Llama 3's by default")
    parser.add_argument("--rows", type=int, default=21, help="questions per micro-batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = tuple(
        ScoreRow(tuple(range(200)), tuple((32 + i,) for i in range(4))) for _ in range(args.rows)
    )
    index = {(i, 199): i for i in range(args.rows)}
    logits = torch.randn(args.rows, args.vocab, device=args.device)
    scorer = Scorer.__new__(Scorer)  # its answers need the rank's softmax dtype alone
    scorer._rank = types.SimpleNamespace(spec=types.SimpleNamespace(softmax_dtype=None))

    def one_by_one() -> Any:
        return [
            [_answer(logits, [index[(i, p)] for p in ps], t, None) for t, ps in
             zip(row.targets, row.scored_positions(), strict=True)]
            for i, row in enumerate(rows)
        ]  # fmt: skip

    def together() -> Any:
        return scorer._answers(rows, logits, index)

    assert one_by_one() == together(), "the answers differ"
    timed = {name: _ms(f, args.repeats) for name, f in (("one by one", one_by_one),
                                                      ("together", together))}  # fmt: skip
    print(f"{args.rows} questions x 4 one-token targets, vocabulary {args.vocab:,}, {args.device}:")
    for name, ms in timed.items():
        print(f"  {name:<11} {ms:8.2f} ms a micro-batch")
    print(f"speed-up: {timed['one by one'] / timed['together']:.2f}x (answers equal)")
    return 0


def _ms(function: Callable[[], Any], repeats: int) -> float:
    """Milliseconds per call, the best of two rounds of ``repeats`` calls."""
    import torch

    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        for _ in range(repeats):
            function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / repeats * 1e3)
    return best


if __name__ == "__main__":
    raise SystemExit(main())
