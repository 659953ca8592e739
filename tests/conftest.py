"""Shared fixtures: tiny checkpoints written once per test session by ``tests/checkpoints.py``."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests never touch the network: the Hub path is exercised against a prepared local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf2q.platform import keep_float32_exact  # noqa: E402

keep_float32_exact()  # as the CLI does: float32 products stay float32 on CUDA

import checkpoints as ck  # noqa: E402
import cuda_emu  # noqa: E402


def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary folder of this test run that all its pytest-xdist workers share (the run's
    root, each worker's own folder is inside it), or this process's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _emulator_builds_shared_by_the_workers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The CUDA emulator builds each program once per run, not once per xdist worker."""
    cuda_emu.BUILD_DIR = shared_tmp(tmp_path_factory) / "cuda_emu"


#: Modules whose module-scoped fixtures are costly: each runs whole on one xdist worker, so they
#: are made once per run instead of once per worker that gets some of the module's tests.
#: test_runtime_lookup: the demo pair and its plain greedy tokens (4-7 s); test_train_draft:
#: the `trained` run, 80 steps with evaluations (10-15 s); test_convert_layouts: `trained`, four
#: checkpoints trained for a few dozen steps (7-8 s).
ONE_WORKER_MODULES = ("test_runtime_lookup.py", "test_train_draft.py", "test_convert_layouts.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist load`` (what ``-n auto`` runs), except that each of :data:`ONE_WORKER_MODULES`
    is one unit of work: xdist's scope scheduler, which hands out the largest units first, with
    every other test a unit of its own. (``--dist loadgroup`` would do this with xdist_group
    marks, but pytest-xdist 3.8 cannot add the group to a pytest 9 node id.) Other --dist modes
    are left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


#: HF2Q_TEST_INSTAFAIL=1: a failing test's report is printed as it fails, not at the end of the
#: run. The GPU calls (benchmarks/h200_common.sh gpu_pytest) run under a time limit that may end
#: the run before pytest's summary (session 50: a failure whose reason was lost so).
INSTAFAIL_ENV = "HF2Q_TEST_INSTAFAIL"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and os.environ.get(INSTAFAIL_ENV) == "1":
        print(f"\n{report.nodeid} ({report.when}) failed:\n{report.longreprtext}", flush=True)


def build_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """``build(folder)``, unless a process of this run has already built it: under a lock, and
    done only when the build finished (a marker beside the folder), so every xdist worker gets
    the same complete folder and the work is done once per run instead of once per worker."""
    done = folder.with_name(folder.name + ".done")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with cuda_emu._locked(folder.with_name(folder.name + ".lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build interrupted half-way
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session checkpoints' folder, shared by the run's xdist workers (tests only read them)."""
    folder = shared_tmp(tmp_path_factory) / "checkpoints"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def qwen35_dir(fixtures_dir: Path) -> Path:
    """Tiny Qwen3_5ForConditionalGeneration (hybrid: 3 Gated-DeltaNet + 1 attention), float32."""
    return build_once(fixtures_dir / "qwen35", lambda f: ck.build_qwen35(f, seed=0))


@pytest.fixture(scope="session")
def qwen35_causal_dir(fixtures_dir: Path) -> Path:
    """Tiny text-only Qwen3_5ForCausalLM, 8 layers, float32."""
    return build_once(
        fixtures_dir / "qwen35_causal",
        lambda f: ck.build_qwen35(f, layout="causal", num_hidden_layers=8, seed=1),
    )


@pytest.fixture(scope="session")
def qwen35_moe_dir(fixtures_dir: Path) -> Path:
    """Tiny Qwen3_5MoeForConditionalGeneration, float32."""
    return build_once(fixtures_dir / "qwen35_moe", lambda f: ck.build_qwen35(f, moe=True, seed=2))


@pytest.fixture(scope="session")
def qwen3_dir(fixtures_dir: Path) -> Path:
    """Tiny plain Qwen3 (pure attention), float32."""
    return build_once(fixtures_dir / "qwen3", lambda f: ck.build_qwen3(f, seed=3))


@pytest.fixture(scope="session")
def drafter_dir(fixtures_dir: Path) -> Path:
    """Random 1-layer DFlash drafter (z-lab format) for the 4-layer tiny targets."""
    return build_once(fixtures_dir / "drafter", lambda f: ck.build_drafter(f, layers=1, seed=4))


# ---- runtime (issue 3): drafters fitted to agree with their tiny targets ------------------------
#: Prompts (cut to 4 tokens) whose greedy continuations the fitted drafters memorise.
FIT_TEXTS = (
    "def add(a, b):",
    "The quick brown fox",
    "Hello world! How",
    "for i in range(10",
    "class Counter:\n",
    "Once upon a time",
)
FIT_NEW_TOKENS = 40


def _fit_pair(
    target_dir: Path,
    out: Path,
    *,
    layers: int,
    ids: list[int],
    n_target: int,
    steps: int,
    seed: int,
    lr: float = 3e-3,
    **cfg: object,
) -> Path:
    """Fit a DFlash drafter to ``target_dir``'s greedy continuations of FIT_TEXTS; save it
    (once per run: see :func:`build_once`)."""
    kw = dict(layers=layers, ids=ids, n_target=n_target, steps=steps, seed=seed, lr=lr)
    return build_once(out, lambda folder: _fit(target_dir, folder, **kw, **cfg))


def _fit(
    target_dir: Path,
    out: Path,
    *,
    layers: int,
    ids: list[int],
    n_target: int,
    steps: int,
    seed: int,
    lr: float,
    **cfg: object,
) -> None:
    import drafter_fit

    from hf2q.loading import load_model
    from hf2q.runtime.drafter import load_drafter, save_drafter
    from hf2q.runtime.target import TargetModel

    raw = ck.build_drafter(
        out / "init",
        layers=layers,
        seed=seed,
        num_target_layers=n_target,
        target_layer_ids=ids,
        **cfg,
    )
    lm = load_model(target_dir)
    target = TargetModel(lm.model, lm.tokenizer)
    drafter = load_drafter(raw).bind(target.embed, target.head)
    prompts = [lm.tokenizer.encode(t)[:4] for t in FIT_TEXTS]
    seqs = drafter_fit.greedy_sequences(target, prompts, FIT_NEW_TOKENS)
    drafter_fit.fit_drafter(target, drafter, seqs, steps=steps, lr=lr, seed=seed)
    save_drafter(drafter, out)


@pytest.fixture(scope="session")
def fitted_pairs(
    fixtures_dir: Path, qwen35_dir: Path, qwen35_causal_dir: Path
) -> dict[str, tuple[Path, Path]]:
    """name -> (target folder, drafter folder fitted to it), so long acceptances and full-block
    accepts really happen: a 1-layer drafter on the 4-layer hybrid Qwen3.5, and a 3-layer one
    with sliding-window layers on the 8-layer text-only Qwen3.5."""
    root = fixtures_dir / "fitted"
    return {
        "qwen35": (
            qwen35_dir,
            _fit_pair(
                qwen35_dir,
                root / "qwen35",
                layers=1,
                ids=[1, 2],
                n_target=4,
                steps=120,
                lr=5e-3,
                seed=10,
            ),
        ),
        "qwen35_causal": (
            qwen35_causal_dir,
            _fit_pair(
                qwen35_causal_dir,
                root / "qwen35_causal",
                layers=3,
                ids=[1, 3, 5],
                n_target=8,
                steps=120,
                lr=5e-3,
                seed=11,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                sliding_window=8,
            ),
        ),
    }


def load_fitted(target_dir: Path, draft_dir: Path):
    """``(lm, target, drafter)`` of a fitted pair: mlx-lm's loaded model, hf2q's ``TargetModel``
    over it, and the drafter bound to the target's embedding and head (fresh objects each call)."""
    from hf2q.loading import load_model
    from hf2q.runtime.drafter import load_drafter
    from hf2q.runtime.target import TargetModel

    lm = load_model(target_dir)
    target = TargetModel(lm.model, lm.tokenizer)
    return lm, target, load_drafter(draft_dir).bind(target.embed, target.head)


def assert_greedy_dflash_equals_plain(
    target, drafter, prompts, max_tokens, *, blocks, slots, eos=()
) -> None:
    """Greedy DFlash of every prompt (each block size in ``blocks``), then all prompts batched on
    ``slots`` slots, give exactly plain greedy decoding's tokens; ``max_tokens[i]`` per prompt."""
    from hf2q.runtime.dflash import dflash_generate, plain_generate, run
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    want = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        plain = run(plain_generate(target, prompt, max_tokens=n, eos_token_ids=eos))
        want.append(plain.tokens)
        for B in blocks:
            events = dflash_generate(
                target, drafter, prompt, max_tokens=n, block_size=B, eos_token_ids=eos
            )
            assert run(events).tokens == plain.tokens, f"prompt {i} block {B}"
    reqs = [Request(p, max_tokens=n) for p, n in zip(prompts, max_tokens, strict=True)]
    batched = run_slots(
        slots_dflash_generate(target, drafter, reqs, slots=slots, eos_token_ids=eos)
    )
    assert [s.tokens for s in batched.requests] == want


def assert_fitted_greedy_dflash_equals_plain(
    fitted_pairs, max_tokens, name: str = "qwen35"
) -> None:
    """:func:`assert_greedy_dflash_equals_plain` on the fitted pair ``name`` with the first
    ``len(max_tokens)`` of ``FIT_TEXTS`` as prompts, blocks 4 and 16, on 2 slots."""
    lm, target, drafter = load_fitted(*fitted_pairs[name])
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[: len(max_tokens)]]
    assert_greedy_dflash_equals_plain(
        target,
        drafter,
        prompts,
        list(max_tokens),
        blocks=(4, 16),
        slots=2,
        eos=lm.tokenizer.eos_token_ids,
    )


def assert_fitted_batched_equals_plain(
    fitted_pairs, *, lagged: bool, lengths=(18, 30, 9, 24, 14), slots: int = 3, block: int = 4
) -> None:
    """Greedy batched DFlash on the fitted ``qwen35`` pair (the first ``len(lengths)`` of
    ``FIT_TEXTS``, ``lengths[i]`` new tokens each, on ``slots`` slots: rows finishing at
    different times and the queue refilling them, the batch compacted; ``lagged`` rounds or not)
    gives each prompt's plain greedy tokens."""
    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    eos = lm.tokenizer.eos_token_ids
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[: len(lengths)]]
    want = [
        run(plain_generate(target, p, max_tokens=n, eos_token_ids=eos)).tokens
        for p, n in zip(prompts, lengths, strict=True)
    ]
    reqs = [Request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    events = slots_dflash_generate(
        target, drafter, reqs, slots=slots, block_size=block, eos_token_ids=eos, lagged=lagged
    )
    assert [s.tokens for s in run_slots(events).requests] == want


def assert_switch_keeps_demo_logits(monkeypatch, env: str, rows: bool = False) -> None:
    """The embedded demo target's logits through the compiled layer runners (small-M products;
    ``rows``: the row-invariant attention) are equal with the switch ``env`` at 0 and at 1: a
    3-token prefill, then decode steps of one row each (a CUDA test's check that a launch keeps
    the bits of what it replaces, in a whole model)."""
    import mlx.core as mx

    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.runtime.pair import load_pair

    target = load_pair(None).target
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(env, flag)
        cache = target.make_cache()
        fn = fast_layer_fn(mm=True, rows=rows)
        steps = [target.forward(tokens[:, :3], cache, layer_fn=fn)[0]]
        for i in range(3, tokens.shape[1]):
            steps.append(target.forward(tokens[:, i : i + 1], cache, layer_fn=fn)[0])
        outs.append(mx.concatenate(steps, axis=1))
    assert mx.array_equal(outs[0], outs[1])


def _has_cuda() -> bool:
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


#: Whether MLX's CUDA backend runs here, and the mark of tests that need it.
HAS_CUDA = _has_cuda()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


@pytest.fixture
def emulated_mm(monkeypatch, tmp_path):
    """The small-M kernel's own source (K-split and column split), run by the CPU emulator in
    place of MLX's CUDA backend."""
    from hf2q.kernels import cuda_matmul as cm

    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    kerns = {
        columns: cuda_emu.EmulatedKernel(
            "hf2q_small_mm", ["x", "w"], ["y"], source, cm._HEADER, workdir=tmp_path
        )
        for columns, source in ((False, cm._SOURCE), (True, cm._SOURCE_COLUMNS))
    }
    monkeypatch.setattr(cm, "_kernel", lambda columns=False: kerns[columns])
    return kerns[False]


@pytest.fixture
def emulated_grouped(emulated_mm, monkeypatch, tmp_path):
    """The grouped kernel's own source, run by the CPU emulator (the single one too)."""
    from hf2q.kernels import cuda_matmul as cm

    kerns = {}

    def grouped(groups, columns=False):
        if (groups, columns) not in kerns:
            kerns[groups, columns] = cuda_emu.EmulatedKernel(
                f"hf2q_grouped_mm{groups}",
                ["x", *(f"w{i}" for i in range(groups))],
                [f"y{i}" for i in range(groups)],
                cm.grouped_source(groups, columns),
                cm._HEADER,
                workdir=tmp_path,
            )
        return kerns[groups, columns]

    monkeypatch.setattr(cm, "_grouped_kernel", grouped)
    return grouped


@pytest.fixture
def emulated_swiglu(emulated_grouped, emulated_add, monkeypatch, tmp_path):
    """The gate/up/SwiGLU kernel's own source, run by the CPU emulator (grouped ones too)."""
    from hf2q.kernels import cuda_matmul as cm

    kern = cuda_emu.EmulatedKernel(
        "hf2q_swiglu_mm",
        ["x", "wg", "wu"],
        ["y"],
        cm._SOURCE_SWIGLU,
        cm._swiglu_header(),
        workdir=tmp_path,
    )
    monkeypatch.setattr(cm, "_swiglu_kernel", lambda: kern)
    return kern


@pytest.fixture
def emulated_add(emulated_mm, monkeypatch, tmp_path):
    """The kernels with the residual in the launch (K-split and column split), emulated too."""
    from hf2q.kernels import cuda_matmul as cm

    adds = {
        columns: cuda_emu.EmulatedKernel(
            "hf2q_small_mm_add", ["x", "w", "r"], ["y"], source, cm._HEADER, workdir=tmp_path
        )
        for columns, source in ((False, cm._SOURCE_ADD), (True, cm._SOURCE_ADD_COLUMNS))
    }
    monkeypatch.setattr(cm, "_add_kernel", lambda columns=False: adds[columns])
    return adds


@pytest.fixture
def emulated_products(emulated_swiglu, monkeypatch, tmp_path):
    """The small-M launches' own sources (plain, with a residual, grouped, SwiGLU, and the
    normed ones of ``HF2Q_NORM_MM``), run by the CPU emulator in place of MLX's CUDA backend."""
    from hf2q.kernels import cuda_matmul as cm

    normed: dict = {}

    def norm_kernel(kind, eps):
        if (kind, eps) not in normed:
            if kind == "single":
                ins, outs, src = ["x", "w"], ["y"], cm._SOURCE_NORMED
            elif kind == "swiglu":
                ins, outs, src = ["x", "wg", "wu"], ["y"], cm._swiglu_source(True)
            elif kind.startswith("joined"):
                n = int(kind.removeprefix("joined"))
                ins = ["x", "c", *(f"w{i}" for i in range(n))]
                outs = [f"y{i}" for i in range(n)]
                src = cm.grouped_source(n, norm=True, joined=True)
            else:
                n = int(kind.removeprefix("grouped"))
                ins = ["x", *(f"w{i}" for i in range(n))]
                outs, src = [f"y{i}" for i in range(n)], cm.grouped_source(n, norm=True)
            normed[kind, eps] = cuda_emu.EmulatedKernel(
                f"hf2q_norm_{kind}_mm",
                [*ins, "nw"],
                outs,
                cm.norm_source(src, eps),
                cm.norm_header(),
                workdir=tmp_path,
            )
        return normed[kind, eps]

    monkeypatch.setattr(cm, "_norm_kernel", norm_kernel)


# ---- `hf2q generate` in this process ------------------------------------------------------------
def run_generate(capsys, *args: str) -> tuple[int, str, str]:
    """``hf2q generate ARGS`` through the CLI's entry point: (exit code, stdout, stderr)."""
    from hf2q.cli.app import main

    code = main(["generate", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def generate_json(capsys, *args: str) -> dict:
    """``hf2q generate ARGS --json``'s record (its last stdout line); the run must succeed."""
    import json

    code, out, err = run_generate(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])
