"""How far a linear layer split over G ranks lands from the one-device product, per dtype and way
of splitting: the measurement behind rayeval's tensor parallelism (actors/tp_exact.py).

For random matrices (``x``: M x K, ``w``: N x K, this machine's kernels, one thread) it compares
``F.linear(x, w)`` on one device with:

* ``row split, partials in dtype`` — transformers' row-parallel layer: each rank multiplies its
  K/G input columns, the partial products are rounded to the dtype and added;
* ``row split, float32 partials`` — the same with the partials kept in float32 and the sum rounded
  once;
* ``column split`` — each rank computes N/G output columns over the whole K (rayeval's layout:
  every sum on one rank), the columns concatenated.

It prints, per shape, the share of output elements that differ from the one-device product (0
means bit-identical). Usage::

    .venv/bin/python benchmarks/bench_split_sums.py                # G = 2, bf16 and float32
    .venv/bin/python benchmarks/bench_split_sums.py --ranks 4 --json out/split.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = [(m, k, n) for m in (1, 4, 16, 64) for k in (256, 1024, 4096) for n in (512, 1024)]


def differ(ours, ref) -> float:  # noqa: ANN001
    """Share of elements whose bits differ."""
    return float((ours != ref).float().mean())


def measure(m: int, k: int, n: int, dtype, ranks: int) -> dict[str, float]:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    ref = F.linear(x, w)
    ks, ns = k // ranks, n // ranks
    parts = [
        F.linear(x[:, r * ks : (r + 1) * ks], w[:, r * ks : (r + 1) * ks]) for r in range(ranks)
    ]
    row_rounded = parts[0].clone()
    for part in parts[1:]:
        row_rounded += part
    partials32 = [
        F.linear(x[:, r * ks : (r + 1) * ks].float(), w[:, r * ks : (r + 1) * ks].float())
        for r in range(ranks)
    ]
    row_fp32 = sum(partials32[1:], partials32[0]).to(dtype)
    columns = torch.cat([F.linear(x, w[r * ns : (r + 1) * ns]) for r in range(ranks)], dim=-1)
    return {
        "row split, partials in dtype": differ(row_rounded, ref),
        "row split, float32 partials": differ(row_fp32, ref),
        "column split": differ(columns, ref),
    }


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="G (2)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for m, k, n in SHAPES:
            rows.append(
                {"dtype": dtype_name, "M": m, "K": k, "N": n, **measure(m, k, n, dtype, args.ranks)}
            )
    ways = [key for key in rows[0] if key not in ("dtype", "M", "K", "N")]
    print(f"G = {args.ranks}; share of output elements that differ from the one-device product")
    print(f"{'dtype':>9} {'M':>3} {'K':>5} {'N':>5} " + " ".join(f"{w:>28}" for w in ways))
    for row in rows:
        cells = " ".join(f"{row[w]:>28.4%}" for w in ways)
        print(f"{row['dtype']:>9} {row['M']:>3} {row['K']:>5} {row['N']:>5} {cells}")
    for dtype_name in args.dtypes.split(","):
        mine = [r for r in rows if r["dtype"] == dtype_name]
        summary = ", ".join(f"{w}: worst {max(r[w] for r in mine):.4%}" for w in ways)
        print(f"{dtype_name}: {summary}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
