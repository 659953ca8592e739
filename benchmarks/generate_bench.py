"""Benchmark ``hf2q generate``: hf2q DFlash vs hf2q plain vs mlx-lm plain vs z-lab's DFlash reference.

Same machine, same run, same prompt token ids, same target and drafter, greedy (T = 0):
generation tok/s with prefill excluded (tokens after the first / time after the first token,
measured the same way for all four), tau, and whether the tokens of all four match. Medians over
trials; implementations are interleaved within each trial so background load hits all alike.

z-lab's ``dflash.model_mlx.stream_generate`` runs in a subprocess because it replaces mlx-lm's
``GatedDeltaNet.__call__`` globally (install it with ``pip install --no-deps dflash==0.1.0``;
``--zlab-path`` adds a folder holding an unpacked copy to ``sys.path``, for machines without a
registry).

Pairs:
  --model M --draft D     any target + DFlash drafter hf2q loads (folders or Hub ids)
  --fixture               a tiny transformers-written Qwen3.5 (hidden 128, 8 layers) with a 2-layer
                          drafter fitted to its greedy continuations of the prompts (memorised:
                          high tau by construction), built once into --work
  --synthetic 4b          random-weight Qwen3.5-4B-shaped target (bf16) + 5-layer z-lab-shaped
                          drafter, built into --work; random drafters give tau ~ 1 (a cost test)

Examples:
  python benchmarks/generate_bench.py --fixture --max-tokens 128 --trials 5
  python benchmarks/generate_bench.py --synthetic 4b --max-tokens 128 --trials 3 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN35_4B_DRAFTER, QWEN35_4B_TARGET  # noqa: E402

from hf2q.platform import keep_float32_exact  # noqa: E402

# As the CLI does: float32 products stay float32 on CUDA (children inherit it, z-lab's too).
keep_float32_exact()

FIXTURE_TEXTS = (
    "def add(a, b):",
    "The quick brown fox",
    "Hello world! How",
    "class Counter:\n",
)
DEFAULT_PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works, with an example in Python.",
    "List the first ten prime numbers and explain why each is prime.",
)


@dataclass
class Run:
    tokens: list[int]
    generation_tps: float
    tau: float | None = None
    cpu_tps: float = 0.0  # tokens after the first per CPU-second of this process (load-robust)


class Stamps:
    """Wall and process-CPU time at the first and the latest token."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def mark(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def rates(self, n_tokens: int) -> tuple[float, float]:
        return _rate(n_tokens, self.wall), _rate(n_tokens, self.cpu)


@dataclass
class Row:
    impl: str
    prompt: int
    tps: list[float] = field(default_factory=list)
    cpu_tps: list[float] = field(default_factory=list)
    tau: float | None = None
    tokens: list[int] = field(default_factory=list)


# ---- pairs -------------------------------------------------------------------------------------
def fixture_pair(work: Path) -> tuple[Path, Path, list[list[int]]]:
    """Tiny Qwen3.5 (hidden 128, 8 layers) + 2-layer drafter fitted to it; memorised prompts."""
    sys.path.insert(0, str(ROOT / "tests"))
    import checkpoints as ck
    import drafter_fit

    from hf2q.loading import load_model
    from hf2q.runtime.drafter import load_drafter, save_drafter
    from hf2q.runtime.target import TargetModel

    tdir, ddir = work / "fixture_target", work / "fixture_draft"
    if not (tdir / "config.json").is_file():
        ck.build_qwen35(
            tdir,
            layout="causal",
            num_hidden_layers=8,
            hidden_size=128,
            intermediate_size=256,
            seed=5,
        )
    lm = load_model(tdir)
    prompts = [lm.tokenizer.encode(t)[:4] for t in FIXTURE_TEXTS]
    if not (ddir / "config.json").is_file():
        raw = ck.build_drafter(
            work / "fixture_draft_init",
            layers=2,
            hidden_size=128,
            num_target_layers=8,
            target_layer_ids=[1, 4, 6],
            seed=6,
        )
        target = TargetModel(lm.model, lm.tokenizer)
        drafter = load_drafter(raw).bind(target.embed, target.head)
        seqs = drafter_fit.greedy_sequences(target, prompts, 140)
        drafter_fit.fit_drafter(target, drafter, seqs, steps=1500, seed=6)
        save_drafter(drafter, ddir)
    return tdir, ddir, prompts


#: Shapes of the synthetic pairs: "4b" is Qwen3.5-4B's text model and z-lab's drafter for it;
#: "tiny" is the same code path small enough to check on a CPU.
_T, _D = QWEN35_4B_TARGET, QWEN35_4B_DRAFTER
SYNTHETIC = {
    "4b": dict(
        hidden=_T["hidden_size"],
        inter=_T["intermediate_size"],
        layers=_T["num_hidden_layers"],
        heads=_T["num_attention_heads"],
        kv=_T["num_key_value_heads"],
        head_dim=_T["head_dim"],
        lv=_T["linear_num_value_heads"],
        lk=_T["linear_num_key_heads"],
        lkd=_T["linear_key_head_dim"],
        lvd=_T["linear_value_head_dim"],
        vocab=_T["vocab_size"],
        d_layers=_D["num_hidden_layers"],
        d_heads=_D["num_attention_heads"],
        d_kv=_D["num_key_value_heads"],
        d_head_dim=_D["head_dim"],
        d_inter=_D["intermediate_size"],
        ids=_D["target_layer_ids"],
        mask=_D["mask_token_id"],
    ),
    "tiny": dict(
        hidden=128,
        inter=256,
        layers=8,
        heads=4,
        kv=2,
        head_dim=32,
        lv=4,
        lk=2,
        lkd=32,
        lvd=32,
        vocab=2048,
        d_layers=2,
        d_heads=4,
        d_kv=2,
        d_head_dim=32,
        d_inter=256,
        ids=[1, 4, 6],
        mask=2040,
    ),
}


def synthetic_pair(work: Path, size: str) -> tuple[Path, Path]:
    """Random-weight Qwen3.5-shaped target (bf16, mlx-lm layout) and a z-lab-shaped drafter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel, save_drafter

    sh = SYNTHETIC[size]
    tdir, ddir = work / f"synthetic{size}_target", work / f"synthetic{size}_draft"
    vocab = sh["vocab"]
    if not (tdir / "config.json").is_file():
        text = dict(
            model_type="qwen3_5_text",
            hidden_size=sh["hidden"],
            intermediate_size=sh["inter"],
            num_hidden_layers=sh["layers"],
            num_attention_heads=sh["heads"],
            num_key_value_heads=sh["kv"],
            head_dim=sh["head_dim"],
            linear_num_value_heads=sh["lv"],
            linear_num_key_heads=sh["lk"],
            linear_key_head_dim=sh["lkd"],
            linear_value_head_dim=sh["lvd"],
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            vocab_size=vocab,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            full_attention_interval=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        )
        cfg = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": text,
            "eos_token_id": [vocab - 2, vocab - 1],
        }
        mx.random.seed(0)
        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
        model.set_dtype(mx.bfloat16)
        tdir.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(tdir / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tdir / "config.json").write_text(json.dumps(cfg, indent=2))
        _write_wordlevel_tokenizer(tdir, vocab)
        del model, weights
    if not (ddir / "config.json").is_file():
        dcfg = DFlashConfig(
            hidden_size=sh["hidden"],
            num_hidden_layers=sh["d_layers"],
            num_attention_heads=sh["d_heads"],
            num_key_value_heads=sh["d_kv"],
            head_dim=sh["d_head_dim"],
            intermediate_size=sh["d_inter"],
            vocab_size=vocab,
            num_target_layers=sh["layers"],
            target_layer_ids=sh["ids"],
            mask_token_id=sh["mask"],
            block_size=16,
            rope_theta=10000000.0,
        )
        mx.random.seed(1)
        d = DFlashDraftModel(dcfg)
        d.set_dtype(mx.bfloat16)
        save_drafter(d, ddir)
    return tdir, ddir


def _write_wordlevel_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer covering every embedding row (synthetic models have no real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{vocab - 2}")
    fast.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [vocab - 2, vocab - 1]})
    )


# ---- implementations ---------------------------------------------------------------------------
def run_hf2q(pair, prompt: list[int], args, dflash: bool, lookup: bool = False) -> Run:
    from hf2q.runtime.dflash import PrefillDone, Summary, dflash_generate, plain_generate

    if dflash:
        events = dflash_generate(
            pair.target,
            pair.drafter,
            prompt,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
            eos_token_ids=pair.eos_token_ids,
            lookup=lookup,
        )
    else:
        events = plain_generate(
            pair.target, prompt, max_tokens=args.max_tokens, eos_token_ids=pair.eos_token_ids
        )
    st = Stamps()
    for ev in events:
        if isinstance(ev, PrefillDone):
            st.mark()
        elif isinstance(ev, Summary):
            st.mark()
            wall, cpu = st.rates(len(ev.tokens))
            return Run(ev.tokens, wall, ev.tau, cpu)
    raise RuntimeError("the generation ended without a summary")


def run_mlx_lm(pair, prompt: list[int], args) -> Run:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    tokens, st = [], Stamps()
    for r in stream_generate(
        pair.target.model,
        pair.tokenizer,
        mx.array(prompt),
        max_tokens=args.max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
    ):
        tokens.append(r.token)
        st.mark()
    wall, cpu = st.rates(len(tokens))
    return Run(tokens, wall, None, cpu)


def _rate(n_tokens: int, stamps: list[float]) -> float:
    """Tokens after the first over the time after the first (prefill excluded)."""
    dt = stamps[-1] - stamps[0]
    return (n_tokens - 1) / dt if dt > 0 and n_tokens > 1 else 0.0


def zlab_worker(args) -> None:
    """Serve z-lab's reference in this (separate) process: one JSON request per stdin line
    (``{"prompt": [...]}``), one JSON result per stdout line, so trials interleave with the
    in-process implementations under the same background load."""
    if args.zlab_path:
        sys.path.insert(0, args.zlab_path)
    import dflash.model_mlx as z

    from hf2q.loading import load_model

    z.snapshot_download = lambda repo_id, **kw: repo_id  # local folders, no Hub
    lm = load_model(args.model)
    draft = z.load_draft(str(args.draft))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)["prompt"]
        tokens, st, acc = [], Stamps(), []
        for r in z.stream_generate(
            lm.model,
            draft,
            lm.tokenizer,
            prompt,
            block_size=args.block_size,
            max_tokens=args.max_tokens,
        ):
            if r.tokens:
                tokens.extend(r.tokens)
                st.mark()
            if r.accepted is not None:
                acc.append(r.accepted)  # z-lab counts a + 1 here
        wall, cpu = st.rates(len(tokens))
        tau = statistics.mean(acc) if acc else None
        print(json.dumps({"tokens": tokens, "tps": wall, "cpu_tps": cpu, "tau": tau}), flush=True)


class ZLab:
    """Client of :func:`zlab_worker` running in a subprocess."""

    def __init__(self, model: Path, draft: Path, args) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--zlab-worker",
            "--model",
            str(model),
            "--draft",
            str(draft),
            "--max-tokens",
            str(args.max_tokens),
            "--block-size",
            str(args.block_size),
        ]
        if args.zlab_path:
            cmd += ["--zlab-path", args.zlab_path]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        self.error = None
        if self._read() is None:
            self.error = "z-lab reference unavailable: " + self._stderr_tail()

    def _read(self) -> dict | None:
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else None

    def _stderr_tail(self) -> str:
        self.proc.wait()
        return (self.proc.stderr.read().strip().splitlines() or ["?"])[-1]

    def run(self, prompt: list[int]) -> Run | None:
        if self.error:
            return None
        self.proc.stdin.write(json.dumps({"prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        rec = self._read()
        if rec is None:
            self.error = "z-lab reference failed: " + self._stderr_tail()
            return None
        return Run(rec["tokens"], rec["tps"], rec["tau"], rec["cpu_tps"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


# ---- main --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--fixture", action="store_true")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC))
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="number of prompts")
    ap.add_argument(
        "--prompt-text",
        action="append",
        default=None,
        help="a prompt (repeatable; replaces the built-in ones, chat template as the pair's default)",
    )
    ap.add_argument("--no-zlab", action="store_true")
    ap.add_argument("--zlab-path", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--zlab-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.zlab_worker:
        zlab_worker(args)
        return

    import mlx.core as mx

    from hf2q.platform import describe, ensure_fast_blas
    from hf2q.runtime.pair import encode_prompt, load_pair

    # Same BLAS as ``hf2q generate`` gives users (OpenBLAS preloaded when installed); the z-lab
    # subprocess inherits the environment, so all four run on the same BLAS.
    ensure_fast_blas(allow_reexec=True)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts: list[list[int]] | None = None
    if args.fixture:
        model, draft, prompts = fixture_pair(work)
    elif args.synthetic:
        model, draft = synthetic_pair(work, args.synthetic)
    else:
        if not (args.model and args.draft):
            raise SystemExit("pass --model and --draft, or --fixture, or --synthetic 4b")
        model, draft = args.model, args.draft
    pair = load_pair(str(model), str(draft))
    if args.block_size is None:
        args.block_size = pair.drafter.block_size
    if prompts is None:
        if args.synthetic:
            mx.random.seed(2)
            top = SYNTHETIC[args.synthetic]["vocab"] - 300  # clear of EOS and MASK rows
            prompts = [mx.random.randint(0, top, (64,)).tolist() for _ in range(args.prompts)]
        else:
            texts = args.prompt_text or DEFAULT_PROMPTS
            prompts = [encode_prompt(pair.tokenizer, t, chat=pair.chat_default) for t in texts]
    if args.fixture:
        # Keep prompts whose greedy continuation does not stop at an EOS early: a run of a few
        # tokens says nothing about decoding speed.
        from hf2q.runtime.dflash import plain_generate, run

        prompts = [
            p
            for p in prompts
            if len(
                run(
                    plain_generate(
                        pair.target, p, max_tokens=args.max_tokens, eos_token_ids=pair.eos_token_ids
                    )
                ).tokens
            )
            == args.max_tokens
        ]
    prompts = prompts[: args.prompts]

    rows: dict[tuple[str, int], Row] = {}
    # "hf2q dflash": the drafter only (what z-lab's reference does); "+lookup": as `hf2q
    # generate` runs by default (rounds may draft by n-gram lookup; same tokens).
    impls = ["hf2q dflash", "hf2q dflash+lookup", "hf2q plain", "mlx-lm plain"]
    zlab = None if args.no_zlab else ZLab(Path(model), Path(draft), args)
    if zlab is not None and zlab.error is None:
        impls.append("z-lab dflash")
    for i, prompt in enumerate(prompts):
        for trial in range(args.trials + 1):  # trial 0 warms up (compiles, allocates)
            for impl in impls:  # interleaved: background load hits every implementation alike
                if impl == "hf2q dflash":
                    r = run_hf2q(pair, prompt, args, dflash=True)
                elif impl == "hf2q dflash+lookup":
                    r = run_hf2q(pair, prompt, args, dflash=True, lookup=True)
                elif impl == "hf2q plain":
                    r = run_hf2q(pair, prompt, args, dflash=False)
                elif impl == "mlx-lm plain":
                    r = run_mlx_lm(pair, prompt, args)
                else:
                    r = zlab.run(prompt)
                    if r is None:
                        raise SystemExit(zlab.error)
                row = rows.setdefault((impl, i), Row(impl, i))
                row.tokens, row.tau = r.tokens, r.tau
                if trial:
                    row.tps.append(r.generation_tps)
                    row.cpu_tps.append(r.cpu_tps)
    if zlab is not None:
        zlab.close()

    facts = describe()
    print(
        f"# {facts['backend']} mlx {facts['mlx']} mlx-lm {facts['mlx_lm']} blas {facts['blas_kind']}"
    )
    print(
        f"# pair: {model} + {draft}, block {args.block_size}, max_tokens {args.max_tokens}, "
        f"{len(prompts)} prompts, {args.trials} trials (medians)"
    )
    if zlab is not None and zlab.error:
        print(f"# {zlab.error}")
    names = [
        n
        for n in ("hf2q dflash", "hf2q dflash+lookup", "hf2q plain", "mlx-lm plain", "z-lab dflash")
        if (n, 0) in rows
    ]
    print(
        "| prompt | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | tau hf2q | tau hf2q+lookup | tau z-lab | tokens | tokens equal (all) |"
    )
    print("|" + "---|" * (len(names) + 6))
    summary: dict[str, list[float]] = {n: [] for n in names}
    result = {"facts": facts, "args": vars(args), "rows": []}
    for i in range(len(prompts)):
        ref = rows[("mlx-lm plain", i)].tokens
        equal = all(rows[(n, i)].tokens == ref for n in names)
        # Where each implementation first departs from mlx-lm's tokens ("=" when identical).
        diverge = {n: _first_diff(rows[(n, i)].tokens, ref) for n in names if n != "mlx-lm plain"}
        meds = {n: statistics.median(rows[(n, i)].tps) for n in names}
        for n in names:
            summary[n].append(meds[n])
        tz = rows.get(("z-lab dflash", i))
        print(
            f"| {i} | "
            + " | ".join(f"{meds[n]:.1f}" for n in names)
            + f" | {_fmt(rows[('hf2q dflash', i)].tau)}"
            + f" | {_fmt(rows[('hf2q dflash+lookup', i)].tau)} | {_fmt(tz.tau if tz else None)}"
            + f" | {len(ref)} | {equal}"
            + ("" if equal else " (" + ", ".join(f"{n}: {d}" for n, d in diverge.items()) + ")")
            + " |"
        )
        result["rows"].append(
            {
                "prompt": i,
                "median_tps": meds,
                "median_cpu_tps": {n: statistics.median(rows[(n, i)].cpu_tps) for n in names},
                "equal": equal,
                "diverge": diverge,
                "tau": {n: rows[(n, i)].tau for n in names},
                **{f"tokens_{n}": rows[(n, i)].tokens for n in names},
            }
        )
    mean = {n: statistics.mean(v) for n, v in summary.items()}
    print("| mean | " + " | ".join(f"{mean[n]:.1f}" for n in names) + " | | | | |")
    cpu = {
        n: statistics.mean(statistics.median(rows[(n, i)].cpu_tps) for i in range(len(prompts)))
        for n in names
    }
    print(
        "# tokens per CPU-second (load-robust), mean of medians: "
        + ", ".join(f"{n} {cpu[n]:.1f}" for n in names)
    )
    result["cpu_tps_mean"] = cpu
    if "z-lab dflash" in mean and mean["z-lab dflash"] > 0:
        print(
            f"# hf2q dflash / z-lab dflash: {mean['hf2q dflash'] / mean['z-lab dflash']:.2f}x "
            f"(per CPU-second {cpu['hf2q dflash'] / cpu['z-lab dflash']:.2f}x); "
            f"hf2q dflash / mlx-lm plain: {mean['hf2q dflash'] / mean['mlx-lm plain']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


def _first_diff(a: list[int], b: list[int]) -> str:
    if a == b:
        return "="
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differs at {n}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
