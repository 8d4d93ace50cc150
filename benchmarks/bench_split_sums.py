"""How far a linear layer split over G ranks lands from the one-device product, per dtype and way
of splitting: the measurement behind rayeval's tensor parallelism (actors/parallel/tp_exact.py).

For random matrices (``x``: M x K, ``w``: N x K, this machine's kernels, one thread) it compares
``F.linear(x, w)`` on one device with:

* ``row split, partials in dtype`` — transformers' row-parallel layer: each rank multiplies its
  K/G input columns, the partial products are rounded to the dtype and added;
* ``row split, float32 partials`` — the same with the partials kept in float32 and the sum rounded
  once;
* ``column split`` — each rank computes N/G output columns over the whole K (rayeval's layout:
  every sum on one rank), the columns concatenated.

It prints, per shape, the share of output elements that differ from the one-device product (0
means bit-identical). ``--sweep`` instead prints, for the layer shapes of real models (K x N from
768 to 11008) and row counts M from 1 (a decode step of one row) to 2048 (a prefill), whether the
column split is bit-identical (``Y``) or not (``n``): the kernel a library picks for a slice of
the columns can differ from the one it picks for the whole layer. Usage::

    .venv/bin/python benchmarks/bench_split_sums.py                # G = 2, three dtypes
    .venv/bin/python benchmarks/bench_split_sums.py --ranks 4 --json out/split.json
    .venv/bin/python benchmarks/bench_split_sums.py --sweep --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = [(m, k, n) for m in (1, 4, 16, 64) for k in (256, 1024, 4096) for n in (512, 1024)]
#: Layer shapes (K, N) of real models: 768-wide, Qwen2-0.5B (896), 2048-wide, Llama-2-7B.
MODEL_SHAPES = [
    (768, 768),
    (768, 2048),
    (2048, 768),
    (896, 896),
    (896, 4864),
    (4864, 896),
    (2048, 2048),
    (2048, 8192),
    (8192, 2048),
    (4096, 4096),
    (4096, 11008),
    (11008, 4096),
]
SWEEP_ROWS = [1, 2, 3, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048]
#: Largest M x K x N the sweep multiplies (bigger products are skipped: '.').
SWEEP_LIMIT = 2048**3


def differ(ours, ref) -> float:
    """Share of elements whose bits differ."""
    return float((ours != ref).float().mean())


def measure(m: int, k: int, n: int, dtype, ranks: int) -> dict[str, float]:
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


def sweep(dtype, ranks: int) -> list[dict[str, object]]:
    """Per model layer shape, which row counts give a bit-identical column split."""
    import torch
    import torch.nn.functional as F

    print(f"{dtype}, G = {ranks}: column split bit-identical (Y) or not (n); M = {SWEEP_ROWS}")
    rows = []
    for k, n in MODEL_SHAPES:
        marks = ""
        for m in SWEEP_ROWS:
            if m * k * n > SWEEP_LIMIT:
                marks += "."
                continue
            g = torch.Generator().manual_seed(m + k + n)
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            step = n // ranks
            split = [F.linear(x, w[r * step : (r + 1) * step]) for r in range(ranks)]
            marks += "Y" if torch.equal(F.linear(x, w), torch.cat(split, dim=-1)) else "n"
        print(f"K {k:>5} N {n:>5}  {marks}", flush=True)
        rows.append({"K": k, "N": n, "rows": SWEEP_ROWS, "identical": marks})
    return rows


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="G (2)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--sweep", action="store_true", help="column splits over M, model shapes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.sweep:
        found = [sweep(getattr(torch, d), args.ranks) for d in args.dtypes.split(",")]
        if args.json:
            args.json.write_text(json.dumps(found, indent=1))
        return
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
