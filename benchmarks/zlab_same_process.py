"""hf2q DFlash vs z-lab's reference in ONE process, alternating runs: a load-robust A/B.

``generate_bench.py`` runs z-lab in a worker process; on a shared machine the two processes can
see different background load. Here both run in this process, one after the other, many times,
and the minimum and median wall and CPU time per generation are reported. z-lab's
``stream_generate`` patches mlx-lm's ``GatedDeltaNet.__call__`` only while it runs (hf2q's verify
does not call it), but it permanently wraps the target's capture layers in light hooks; both
implementations therefore run through those hooks. Greedy; tokens are checked equal.

Example:
  OPENBLAS_NUM_THREADS=1 python benchmarks/zlab_same_process.py \\
      --model runs/bench/fixture_target --draft runs/bench/fixture_draft --runs 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument(
        "--prompt-tokens", type=int, default=4, help="cut the prompt to this many tokens"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=12)
    args = ap.parse_args()

    from hf2q.platform import describe, ensure_fast_blas

    ensure_fast_blas(allow_reexec=True)
    import dflash.model_mlx as z

    from hf2q.runtime.dflash import dflash_generate, run
    from hf2q.runtime.pair import load_pair

    z.snapshot_download = lambda repo_id, **kw: repo_id  # local folders, no Hub
    pair = load_pair(args.model, args.draft)
    zdraft = z.load_draft(args.draft)
    prompt = pair.tokenizer.encode(args.prompt)[: args.prompt_tokens]

    def hf2q() -> list[int]:
        return run(
            dflash_generate(
                pair.target,
                pair.drafter,
                prompt,
                max_tokens=args.max_tokens,
                eos_token_ids=pair.eos_token_ids,
            )
        ).tokens

    def zlab() -> list[int]:
        out: list[int] = []
        for r in z.stream_generate(
            pair.target.model, zdraft, pair.tokenizer, prompt, max_tokens=args.max_tokens
        ):
            out.extend(r.tokens)
        return out

    res: dict[str, list[tuple[float, float]]] = {"hf2q dflash": [], "z-lab dflash": []}
    toks: dict[str, list[int]] = {}
    for i in range(args.runs + 1):  # run 0 warms both up
        for name, fn in (("hf2q dflash", hf2q), ("z-lab dflash", zlab)):
            w0, c0 = time.perf_counter(), time.process_time()
            toks[name] = fn()
            if i:
                res[name].append((time.perf_counter() - w0, time.process_time() - c0))
    facts = describe()
    print(
        f"# {facts['backend']} blas {facts['blas_kind']}; {args.runs} alternated runs, "
        f"{len(toks['hf2q dflash'])} tokens each; tokens equal: "
        f"{toks['hf2q dflash'] == toks['z-lab dflash']}"
    )
    for name, v in res.items():
        wall, cpu = [x[0] * 1000 for x in v], [x[1] * 1000 for x in v]
        print(
            f"{name}: wall min {min(wall):.1f} ms, median {statistics.median(wall):.1f} ms | "
            f"CPU min {min(cpu):.1f} ms, median {statistics.median(cpu):.1f} ms"
        )


if __name__ == "__main__":
    main()
