"""Print the rows of a ``hf2q bench --json`` report (or ``slots_synthetic.py``'s) one per line.

Used by the H200 scripts to show a call's results in its output; the JSON file is the record.

Usage: python3 benchmarks/bench_rows.py REPORT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q.cli.bench_view import host_line  # noqa: E402


def main(path: str) -> None:
    r = json.loads(Path(path).read_text())
    if "wall_s" in r:
        print(r.get("model"), "| wall", r["wall_s"], "s |", r.get("platform", {}).get("device"))
    if "host" in r:  # hf2q bench's record of the host's Python speed (since session 32)
        print(host_line(r["host"]))
    for x in r["results"]:
        print(
            f"{x['slots']:>2} {x['mode']:<10} {x['tokens_per_s']:>9} tok/s  round {x['round_ms']} ms"
            f"  split {x['draft_ms']}/{x['verify_ms']}/{x['rollback_ms']}  busy {x['busy_rows']}"
            f"  tau {x['tau']}  E {x['E']}  x1slot {x['scaling_vs_1_slot']}"
            f"  xplain {x['speedup_vs_plain']}  = {x['matches_plain']}  lookup {x.get('lookup_share')}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
