"""Rounds and acceptance of batched DFlash with drafts queued ahead (``draft_ahead``) or drafted
after each round is read, on the embedded demo pair (synchronous lookup rounds, greedy).

Why: a draft queued before the round is read is built from the round's results on the device
(its features with the kept counts, its bonus tokens); if that context were wrong the drafts
would still be verified losslessly but accept less, and the loop would need more rounds. Any
device: rounds and acceptance do not depend on speed. It also counts the drafter's forwards:
drafting ahead runs the drafter before it is known whether the next round uses it, where drafting
after the read skips it for rounds whose rows all verify their lookup proposals.

Usage:
    python benchmarks/ahead_rounds.py --slots 1,3,8 --tokens 64 --out ahead.json
"""

from __future__ import annotations

import argparse
import json

from hf2q.runtime.bench import BUILTIN_PROMPTS
from hf2q.runtime.pair import encode_prompt, load_pair
from hf2q.runtime.slots import Request, SlotRound, slots_dflash_generate


class Counted:
    """The drafter, counting its forwards (every other attribute is the drafter's own)."""

    def __init__(self, drafter):
        self.drafter, self.forwards = drafter, 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.drafter(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="1,3,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pair = load_pair(None, None)
    prompts = [encode_prompt(pair.tokenizer, p, chat=False) for p in BUILTIN_PROMPTS]
    rows, tokens = [], {}
    for slots in (int(s) for s in args.slots.split(",")):
        for ahead in (False, True):
            reqs = [Request(p, max_tokens=args.tokens) for p in prompts]
            drafter = Counted(pair.drafter)
            events = list(
                slots_dflash_generate(
                    pair.target,
                    drafter,
                    reqs,
                    slots=slots,
                    lookup=True,
                    lagged=False,
                    draft_ahead=ahead,
                )
            )
            tokens[slots, ahead] = [r.tokens for r in events[-1].requests]
            rounds = [e for e in events if isinstance(e, SlotRound)]
            row_rounds = sum(len(e.slots) for e in rounds)
            accepted = sum(sum(e.accepted) for e in rounds)
            drafted = [a for e in rounds for a, s in zip(e.accepted, e.sources) if s == "drafter"]
            # Rounds whose next round verified drafts queued ahead (every row busy, not every
            # row on its lookup proposal, no finished row's place taken by a queued request:
            # rows that finish leave the others' drafts), and how many of those drafts the next
            # round did not use because its row picked its lookup proposal instead; "all": every
            # row did, a drafter pass that drafting after the read would have skipped.
            queued = [
                (e, n)
                for e, n in zip(rounds, rounds[1:])
                if ahead
                and len(e.slots) == e.rows
                and (not e.finished or n.rows < e.rows)
                and any(s == "drafter" for s in e.sources)
            ]
            row = {
                "slots": slots,
                "draft_ahead": ahead,
                "rounds": len(rounds),
                "row_rounds": row_rounds,
                "tau": round((accepted + row_rounds) / row_rounds, 3),
                "drafter_rows": len(drafted),
                "drafter_accepted_mean": round(sum(drafted) / max(len(drafted), 1), 3),
                "drafter_forwards": drafter.forwards,
                "ahead_drafts": len(queued),
                "ahead_rows_unused": sum(s == "lookup" for _, n in queued for s in n.sources),
                "ahead_all_unused": sum(all(s == "lookup" for s in n.sources) for _, n in queued),
                "tokens_equal_drafting_after_read": tokens[slots, ahead] == tokens[slots, False],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"tokens": args.tokens, "results": rows}) + "\n")


if __name__ == "__main__":
    main()
