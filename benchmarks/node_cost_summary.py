"""Summarise a node_cost.py JSON: per shape and row count, MLX's matmul, hf2q's kernel with its
default launch shape, and the fastest tuned launch shapes (device time per product, us).

    python benchmarks/node_cost_summary.py runs/node_cost.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main() -> None:
    with open(sys.argv[1]) as f:
        d = json.load(f)
    groups = defaultdict(dict)
    for r in d["results"]:
        groups[(r["K"], r["N"], r["rows"])][r["kind"]] = r
    for (K, N, rows), kinds in groups.items():
        base = kinds.get("mlx_matmul", {})
        ours = kinds.get("hf2q_small_mm", {})
        tuned = sorted(
            (r["total_us"], k) for k, r in kinds.items() if k.startswith("hf2q_small_mm(")
        )
        print(
            f"K={K} N={N} rows={rows}: mlx {base.get('total_us')} us ({base.get('GB_s')} GB/s, "
            f"encode {base.get('encode_us')}); hf2q {ours.get('total_us')} us ({ours.get('GB_s')} "
            f"GB/s, encode {ours.get('encode_us')}); best tuned {tuned[:4]}"
        )


if __name__ == "__main__":
    main()
