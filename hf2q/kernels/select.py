"""Which implementation of each hot spot runs here, chosen automatically and reportable.

What it does: look at the device MLX computes on (CUDA, Apple GPU, CPU) and the shapes of the
layer, and pick

* for the Gated-DeltaNet recurrence over a verify block (``gated_delta_steps``): the CUDA kernel
  when MLX's CUDA backend is the default device and the shapes are supported, ops otherwise;
* for a whole Gated-DeltaNet mixer (:mod:`hf2q.kernels.gdn`): ``"cuda"`` (fused kernel) on CUDA,
  ``"mlx"`` (mlx-lm's ``gated_delta_update``, its Metal kernel) on Apple GPUs, ``"ops"`` on CPU;
* for what a verify keeps for its rollback (:func:`gdn_record`): the state after every position
  (restored on CUDA for all layers in one launch), or where that record would be large on CUDA
  only the last state, the kept steps replayed;

and report what runs.

``HF2Q_KERNELS=ops`` forces the portable ops everywhere (to compare or to rule the kernels out);
``HF2Q_KERNELS=cuda`` insists on the CUDA kernels and fails loudly where they cannot run;
``HF2Q_COMPILE=0`` turns ``mx.compile`` of the layer runners off; ``HF2Q_FUSE_PROJ=1`` makes them
and the drafter concatenate each layer's projections; ``HF2Q_SMALL_MM=0`` keeps their bf16/fp16
products with few rows on MLX's matmul instead of hf2q's tensor-core kernel
(:func:`small_mm_enabled`); ``HF2Q_ROW_ATTENTION=0`` keeps MLX's attention in them (and in the
drafter) instead of hf2q's row-invariant kernel (:func:`row_attention_enabled`).
:func:`sdpa_bucket` says whether multi-token attention pads its keys to a bucket length
(``HF2Q_SDPA_BUCKET``; on CUDA by default); :func:`flush_layers` how often a verify forward queues
its graph (``HF2Q_FLUSH_LAYERS``; off by default).
:func:`describe` returns what is active, for ``--stats``.

What it does not do: run anything itself beyond a dispatch in :func:`gated_delta_steps`.
"""

from __future__ import annotations

import os

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.kernels import cuda_matmul, linear

ENV = "HF2Q_KERNELS"
MODES = ("auto", "ops", "cuda")
#: HF2Q_COMPILE=0 runs the layer runners without mx.compile (same math, more launches).
COMPILE_ENV = "HF2Q_COMPILE"
#: HF2Q_SDPA_BUCKET=N pads the keys of multi-token attention to a multiple of N (0: never).
SDPA_BUCKET_ENV = "HF2Q_SDPA_BUCKET"
#: The default bucket on CUDA: mlx-lm's KV cache step, so padded keys stay inside the buffer.
SDPA_BUCKET_CUDA = 256


#: HF2Q_FUSE_PROJ=1: the target's compiled layer runners (CUDA) compute a layer's input
#: projections with one matmul and the MLP's gate/up with one, and so does the DFlash drafter (q/k/v
#: of context and block rows together); fewer, larger matmuls, from a copy of those weights.
FUSE_PROJ_ENV = "HF2Q_FUSE_PROJ"


#: HF2Q_SMALL_MM=0: hf2q's decoding paths keep MLX's matmul for products with few rows instead of
#: the tensor-core kernel of :mod:`hf2q.kernels.cuda_matmul` (CUDA only; default on there).
SMALL_MM_ENV = "HF2Q_SMALL_MM"

#: HF2Q_SMALL_QMM=0: where the small-M kernel runs, quantized layers (MLX's affine 4- or 8-bit,
#: ``nn.QuantizedLinear`` and a tied ``nn.QuantizedEmbedding`` head) keep MLX's quantized product
#: instead of the kernel's dequantizing variant (``cuda_matmul.small_qmatmul_cuda``). MLX's
#: product computes a row differently at different row counts (session 34: its rows of a 16-row
#: verify never equalled the one-row decode step's), so with it greedy DFlash on a quantized
#: target parts from plain decoding; the kernel keeps the bits (default on).
SMALL_QMM_ENV = "HF2Q_SMALL_QMM"

#: HF2Q_GROUPED_MM=0: where the small-M kernel runs, products sharing an input (a Gated-DeltaNet
#: layer's four input projections, attention's q/k/v, the MLP's gate and up) are one launch of
#: :func:`hf2q.kernels.cuda_matmul.grouped_matmul_cuda` (same bits as separate launches; no copy),
#: residual adds in the product's launch; 0 turns that off (on by default: plain decoding 0.4-12%
#: faster a token on the H200 in three alternating A/Bs, sessions 16 and 19).
GROUPED_MM_ENV = "HF2Q_GROUPED_MM"

#: HF2Q_MM_COLUMNS=0: the small-M kernel's products of three or four m-tiles (33-64 rows: a
#: verify of three or four slots) with at least ``cuda_matmul.COLUMN_MIN_BLOCKS`` thread blocks
#: (a head) split K among a block's warps as every other product does, instead of splitting the
#: columns and staging the input once a block (``cuda_matmul.column_shape``); the same bits
#: either way. On by default: the 4B-shaped pair's verify head at 64 rows 579 -> 458 us on the
#: H200 (session 26).
MM_COLUMNS_ENV = "HF2Q_MM_COLUMNS"

#: HF2Q_MM_SWIGLU=1: where products sharing an input are one launch (:data:`GROUPED_MM_ENV`), an
#: MLP's gate and up products and its SwiGLU are one launch
#: (:func:`hf2q.kernels.cuda_matmul.swiglu_matmul_cuda`, the bits of the grouped launch and
#: mlx-lm's ``swiglu``; so on an H200, session 58): one graph node less a layer. Default off: the
#: 4-slot round of the 4B-shaped pair went 7.974 -> 8.179 ms with it (H200, in one process), and
#: at one slot a noisy host left no verdict.
MM_SWIGLU_ENV = "HF2Q_MM_SWIGLU"

#: HF2Q_MM_SWIGLU_ROWS=N: under ``HF2Q_MM_SWIGLU=1``, the one launch only for products of up to
#: N rows (the grouped launch and mlx-lm's ``swiglu`` above): 16 keeps it to one m-tile (a 1-slot
#: verify, plain steps) where four slots' 64 rows lost with it (session 58). Default: every row
#: count the launch takes.
MM_SWIGLU_ROWS_ENV = "HF2Q_MM_SWIGLU_ROWS"

#: HF2Q_NORM_MM=1: where products sharing an input are one launch (:data:`GROUPED_MM_ENV`), a
#: decoder layer's ``input_layernorm`` and ``post_attention_layernorm`` (``nn.RMSNorm``) are
#: computed in the launches of the products that read them (``norm=`` of
#: :mod:`hf2q.kernels.cuda_matmul`: each thread block norms the rows it multiplies, with the bits
#: of MLX's norm kernel): two graph nodes less a layer; in the drafter's graph a layer's k/v
#: launch also takes its context rows and its normed block rows as they come (no copy joining
#: them: :func:`hf2q.kernels.cuda_matmul.joined_matmul_cuda`). Default off until timed on a GPU.
NORM_MM_ENV = "HF2Q_NORM_MM"

#: HF2Q_NORM_MM_ROWS=N: under ``HF2Q_NORM_MM=1``, only products of up to N rows (default 16: one
#: m-tile, a 1-slot verify, a plain step, a 1-slot draft); every thread block reads its rows
#: once more to sum their squares, which costs more with more rows. Where a verify has more
#: rows than N and its plain steps fewer (four slots: 64 and 4), the two take MLX's norm and the
#: launch's: the same bits only while the launch sums in MLX's order, which MLX 0.32.1 changed
#: (the CUDA tests compare them on the MLX installed).
NORM_MM_ROWS_ENV = "HF2Q_NORM_MM_ROWS"

#: HF2Q_SMALL_MM_ROWS=N: products of up to N rows run the small-M kernel whatever the weight's size;
#: beyond N, weights of more than 4M elements go to cuBLAS (default: the kernel's 128 rows).
SMALL_MM_ROWS_ENV = "HF2Q_SMALL_MM_ROWS"

#: HF2Q_DRAFT_MM_ROWS=N: a drafter forward of more than N block rows (all slots' rows together)
#: runs its products and its head with MLX's matmul (cuBLAS) instead of the small-M kernel, where
#: its largest weight (the head) has more than ``linear.SMALL_WEIGHT`` elements (small drafters'
#: products stay on the kernel, one graph node each). Draft logits only propose tokens (the verify
#: decides them), so they need not be row-invariant; 0: such drafters never use the kernel.
#: Default 64 (four slots' 16-token blocks): the layers' products of a 4B drafter at 48-64 rows
#: cost the kernel what they cost cuBLAS on the H200 or less (session 26, ``node_cost.py
#: --tune``: 2560 x 9216 32.2 / 37.0 us at 48 rows, 37.6 / 35.2 at 64; 9216 x 2560 30.5 / 38.3,
#: 34.7 / 46.1) and each cuBLAS product costs the host a descriptor and a heuristic; in a 4-slot
#: round the drafter's device time was the same (kernel traces) and the round 12.72 -> 11.33 ms
#: (medians of 5 alternating in one process; minimums 10.56 / 10.47) on a host-bound machine.
#: At 128 rows cuBLAS is faster (36.7 against 50.2). Session 19 had set 32 for the head's sake
#: (kernel 860 us at 64 rows, cuBLAS 428), which now has its own count.
DRAFT_MM_ROWS_ENV = "HF2Q_DRAFT_MM_ROWS"
DRAFT_MM_ROWS = 64

#: HF2Q_DRAFT_HEAD_MM_ROWS=N: the drafter's head runs the small-M kernel up to N block rows
#: (unset: :data:`DRAFT_HEAD_MM_ROWS`, or ``HF2Q_DRAFT_MM_ROWS`` where that is fewer), MLX's
#: matmul beyond: on the H200 cuBLAS beats the kernel on the 2560 x 248320 head from 48 rows
#: (session 26: 515 / 581 us at 48 rows, 472 / 704 at 64, 452 / 1007 at 128).
DRAFT_HEAD_MM_ROWS_ENV = "HF2Q_DRAFT_HEAD_MM_ROWS"
DRAFT_HEAD_MM_ROWS = 32

#: HF2Q_ROW_ATTENTION=0: the compiled attention runners keep MLX's attention instead of the
#: row-invariant kernel of :mod:`hf2q.kernels.cuda_attention` (CUDA only; default on there).
ROW_ATTENTION_ENV = "HF2Q_ROW_ATTENTION"

#: HF2Q_FLUSH_LAYERS=N: a verify forward queues its graph for the device (``mx.async_eval``) after
#: every N layers, so the device can compute the first layers while the host builds the rest
#: (0: the whole forward is queued at once; default :data:`LAGGED_FLUSH_LAYERS` in lagged rounds,
#: 0 in synchronous ones). A verify run as one compiled graph is queued as soon as it is built
#: where N > 0, before the round's acceptance and rollback are built.
FLUSH_LAYERS_ENV = "HF2Q_FLUSH_LAYERS"

#: Layers between the queuings of a lagged round's verify (``HF2Q_FLUSH_LAYERS`` unset).
LAGGED_FLUSH_LAYERS = 8

#: HF2Q_PREFILL_RUNNERS=0: prompt chunks go through the model's own layer calls instead of the
#: compiled layer runners (the fused Gated-DeltaNet kernel over the whole chunk; CUDA only, on by
#: default there).
PREFILL_RUNNERS_ENV = "HF2Q_PREFILL_RUNNERS"

#: HF2Q_COMPILE_FORWARD: plain decoding runs each step's whole target forward as one compiled
#: graph (:mod:`hf2q.kernels.forward`) where the runners run (CUDA; default on there where the
#: bits equal the layer path's, see :func:`compile_forward_enabled`); 0 turns it off.
COMPILE_FORWARD_ENV = "HF2Q_COMPILE_FORWARD"

#: HF2Q_COMPILE_VERIFY: a DFlash verify of full blocks (one sequence, or every row of a batched
#: round) runs the target's whole forward as one compiled graph
#: (:class:`hf2q.kernels.forward.CompiledVerify`), as the plain step does (same default, same
#: rule: where the bits equal the layer path's); 0 turns it off.
COMPILE_VERIFY_ENV = "HF2Q_COMPILE_VERIFY"

#: HF2Q_COMPILE_DRAFT: the drafter's forward of a full block runs as one compiled graph
#: (:class:`hf2q.runtime.draft_graph.CompiledDraft`) instead of layer by layer (default on CUDA,
#: off elsewhere; see :func:`compile_draft_enabled`).
COMPILE_DRAFT_ENV = "HF2Q_COMPILE_DRAFT"

#: HF2Q_LAGGED_ROUNDS: DFlash without lookup (``hf2q generate --dflash --no-lookup``,
#: ``hf2q bench --no-lookup``) queues each round before reading the previous round's acceptance
#: (default on CUDA, off elsewhere; 0 or 1 forces it).
LAGGED_ROUNDS_ENV = "HF2Q_LAGGED_ROUNDS"

#: HF2Q_LAG_DEPTH=N (2-4): lagged rounds in flight before the host reads the oldest one's
#: acceptance (default 2: round k+1 queued, then round k read). For A/B runs: session 44's
#: one-slot trace has the device idle twice a round while the host waits once
#: (docs/BENCHMARKS.md, session 45).
LAG_DEPTH_ENV = "HF2Q_LAG_DEPTH"

#: HF2Q_LAGGED_LOOKUP=1: with lookup drafts too (the CLI's default), rounds are lagged while
#: every sequence drafts with the drafter and synchronous while one's lookup proposal is due
#: (default off: slower on the H200 and on CPUs). ``device``: batched greedy rounds
#: (``hf2q bench --slots``) build the lookup proposals and choices on the device
#: (``hf2q.runtime.lookup.RowsLookup``) and stay lagged; elsewhere as ``1``.
LAGGED_LOOKUP_ENV = "HF2Q_LAGGED_LOOKUP"
LAGGED_LOOKUP_MODES = ("0", "1", "device")

#: HF2Q_LAGGED_DRAFT_FIRST=0: a lagged round builds its whole graph before queuing any of it,
#: instead of queuing its draft (``mx.async_eval``) before it builds the verify (default 1; see
#: :func:`lagged_draft_first`).
LAGGED_DRAFT_FIRST_ENV = "HF2Q_LAGGED_DRAFT_FIRST"

#: HF2Q_GDN_RECORD=states|final: what a verify through the compiled runners (CUDA) keeps of each
#: Gated-DeltaNet layer for the rollback, every step's state or the final state (its rollback
#: replays each row's kept steps). Unset: ``final`` where a layer's per-step record would take
#: at least :data:`GDN_FINAL_MIN_BYTES`, ``states`` below (see :func:`gdn_record`).
GDN_RECORD_ENV = "HF2Q_GDN_RECORD"

#: From this size of one layer's per-step record (rows x block x state, float32) the default
#: record is the final state. On the H200 (docs/BENCHMARKS.md, session 23) the 4B-shaped pair
#: (32 MiB a row at 16-token blocks) took 12.30 -> 11.74 ms a round at 4 slots (128 MiB) and
#: 16.84 -> 15.69 at 8 with the final state, 8.40 / 8.42 at 2, and 10.88 -> 12.00 at one; the
#: demo pair (8 MiB at 8 slots), bound by the host, lost with it (rollback 0.66 -> 1.22 ms at
#: 8 slots): the replay's launches cost the host more than the copy it saves the device. Since
#: every layer's replay is one launch (``HF2Q_REPLAY_LAYERS``), an H100 (session 45, the
#: records alternating in one process) gave the final state 7.64 -> 7.32 ms at one slot (32 MiB)
#: and 8.88 -> 8.40 at two: from 32 MiB on. Smaller records (the demo pair) stay per-step,
#: unmeasured with the joined replay.
GDN_FINAL_MIN_BYTES = 32 << 20

#: HF2Q_ROLLBACK_KERNEL=0: a verify's Gated-DeltaNet rollback runs per layer with ops instead of
#: one launch of :mod:`hf2q.kernels.cuda_rollback` for all layers (CUDA only; default on there).
ROLLBACK_KERNEL_ENV = "HF2Q_ROLLBACK_KERNEL"

#: HF2Q_ROUND_WORDS=0: a lagged round's host reads its accepted counts, drafts, bonus tokens and
#: cache offsets as arrays instead of as 8-byte words packed by one launch of
#: :mod:`hf2q.kernels.cuda_readback` (CUDA only, default on there; the same values).
ROUND_WORDS_ENV = "HF2Q_ROUND_WORDS"

#: HF2Q_HOST_PIECES=0|1: the small integer arrays rounds make from host values (last tokens, kept
#: counts, offsets: more than 8 bytes from 3 rows) are joined on the device from arrays of at
#: most 8 bytes (1) or made whole (0) (:func:`hf2q.kernels.cuda_readback.host_ints`; same
#: values). Default on CUDA only.
HOST_PIECES_ENV = "HF2Q_HOST_PIECES"

#: HF2Q_ACCEPT_KERNEL=1: a greedy round's acceptance and kept counts in one launch
#: (:func:`hf2q.kernels.cuda_accept.accept_greedy_cuda`; integers, the same values) instead of
#: about ten small ops. CUDA only; default off until timed on the H200.
ACCEPT_KERNEL_ENV = "HF2Q_ACCEPT_KERNEL"

#: HF2Q_REPLAY_LAYERS=0: a final-state record's rollback replays each Gated-DeltaNet layer in
#: its own launch instead of every layer in one (:func:`hf2q.kernels.gdn.replay_layers`; CUDA
#: only, default on there; same bits).
REPLAY_LAYERS_ENV = "HF2Q_REPLAY_LAYERS"

#: HF2Q_GDN_WINDOW=0: the fused Gated-DeltaNet kernel's caller joins the conv rows before a block
#: and the block's rows with a concatenate (two copy launches a layer) instead of the kernel
#: writing that window itself (default on; only where the fused kernel runs).
GDN_WINDOW_ENV = "HF2Q_GDN_WINDOW"

#: HF2Q_GATED_NORM=0: a Gated-DeltaNet layer's gated norm runs as mlx-lm's two launches
#: (``rms_norm``, then its ``precise_swiglu``) instead of one
#: (:func:`hf2q.kernels.cuda_norm.gated_norm_cuda`, the same bits: so on an H100, session 59)
#: where the fused kernel runs: 24 graph nodes fewer in each forward of a 4B-shaped Qwen3.5.
#: Default on (the fused kernel runs on CUDA only): on an H100, alternating in one process, the
#: plain step 4.200 -> 4.151 ms and the 1-slot round 5.926 -> 5.874 ms, tokens equal.
GATED_NORM_ENV = "HF2Q_GATED_NORM"

#: HF2Q_ATTN_GATE=1: Qwen3.5's attention output gate (``o * sigmoid(gate)``, a launch after the
#: attention plus a copy of the gate out of the q projection) is applied in the row-invariant
#: attention launch's store, read from the projection in place (the same bits by construction):
#: 16 graph nodes fewer in each forward of a 4B-shaped Qwen3.5. Default off until the H200 has
#: confirmed its bits.
ATTN_GATE_ENV = "HF2Q_ATTN_GATE"

#: HF2Q_NORM_ROPE=1: an attention layer's query and key norms and their RoPE (with the copies MLX
#: makes around them: out of the projection's strided view, before a partial rotation, of the
#: transposed queries) are one launch each (:func:`hf2q.kernels.cuda_norm.norm_rope_cuda`, the
#: same bits by construction), in the target's attention layers and the drafter's graph. Default
#: off until the H200 has confirmed its bits.
NORM_ROPE_ENV = "HF2Q_NORM_ROPE"

#: HF2Q_KV_ROW_SCATTER=0|1: a one-row slot cache whose position only the device knows (a lagged
#: round at one slot) writes its new keys and values with the scatter the many-row caches use (1)
#: or with a slice update at a device offset (0: two launches, the offset and a dynamic copy).
#: Default on CUDA: the scatter. Kernel traces of a 1-slot round of the 4B-shaped pair on the H200
#: (session 27, run 2): 585 launches and 5.77 ms device busy against 610 and 5.88 (the 36 dynamic
#: copies 0.37 ms and their offsets 0.09, against 36 scatters of 0.15 ms); tokens equal. Elsewhere
#: the slice update (untimed there).
KV_ROW_SCATTER_ENV = "HF2Q_KV_ROW_SCATTER"
#: HF2Q_DRAFT_AHEAD=1: a synchronous batched round (lookup proposals due) queues the next round's
#: drafter from this round's results on the device before reading them, so the device drafts
#: while the host reads, commits and picks proposals (every row busy; sampled rounds draw each
#: draft with the key the row's next drafted round takes). Default on CUDA.
DRAFT_AHEAD_ENV = "HF2Q_DRAFT_AHEAD"


def _flag(env: str, default: str) -> bool:
    value = os.environ.get(env, default).strip().lower() or default
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise UsageError(f"{env}={value!r} must be 0 or 1: unset it or fix it")
    return value not in ("0", "false", "off")


def _count(env: str, what: str) -> int | None:
    """``env`` as a count (0 meaning off), None when unset; a bad value is an error naming it."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"{env}={raw!r} must be 0 (off) or {what}: fix or unset it")
    return value


def compile_enabled() -> bool:
    """Whether the layer runners use ``mx.compile`` (``HF2Q_COMPILE``, default on)."""
    return _flag(COMPILE_ENV, "1")


def fuse_proj_enabled() -> bool:
    """Whether layers concatenate their projections (``HF2Q_FUSE_PROJ``, default off: it holds a
    second copy of those weights; no gain on a CPU, not yet timed on a GPU)."""
    return _flag(FUSE_PROJ_ENV, "0")


def small_mm_enabled() -> bool:
    """Whether hf2q's decoding paths run products with few rows (bf16/fp16, unquantized) through
    the tensor-core kernel (:mod:`hf2q.kernels.linear`): on CUDA unless ``HF2Q_KERNELS=ops`` or
    ``HF2Q_SMALL_MM=0``; never elsewhere (the kernel is CUDA-only)."""
    return backend() == "cuda" and kernel_mode() != "ops" and _flag(SMALL_MM_ENV, "1")


def small_qmm_enabled() -> bool:
    """Whether quantized layers' products go to the small-M kernel's dequantizing variant where
    :func:`small_mm_enabled` (``HF2Q_SMALL_QMM``, default on)."""
    return small_mm_enabled() and _flag(SMALL_QMM_ENV, "1")


def grouped_mm_enabled() -> bool:
    """Whether products sharing an input are one launch of the small-M kernel
    (``HF2Q_GROUPED_MM``, default on; only where :func:`small_mm_enabled`)."""
    return small_mm_enabled() and _flag(GROUPED_MM_ENV, "1")


def mm_columns_enabled() -> bool:
    """Whether the small-M kernel uses its column-split layout where it applies
    (``HF2Q_MM_COLUMNS``, default on; only where :func:`small_mm_enabled`; same bits)."""
    return small_mm_enabled() and _flag(MM_COLUMNS_ENV, "1")


def mm_swiglu_enabled() -> bool:
    """Whether an MLP's gate, up and SwiGLU are one launch of the small-M kernel
    (``HF2Q_MM_SWIGLU``, default off; only where :func:`grouped_mm_enabled`; same bits)."""
    return grouped_mm_enabled() and _flag(MM_SWIGLU_ENV, "0")


def mm_swiglu_rows() -> int:
    """The most rows whose MLP takes the one gate/up/SwiGLU launch under :func:`mm_swiglu_enabled`
    (``HF2Q_MM_SWIGLU_ROWS``; default and most the kernel's :data:`cuda_matmul.MAX_ROWS`)."""
    return _kernel_rows(MM_SWIGLU_ROWS_ENV, cuda_matmul.MAX_ROWS)


def norm_mm_enabled() -> bool:
    """Whether decoder layers' RMS norms run in the launches of the products reading them
    (``HF2Q_NORM_MM``, default off; only where :func:`grouped_mm_enabled` and the installed MLX
    sums its norms in the launches' order, :func:`cuda_matmul.norm_order_known`; same bits)."""
    return grouped_mm_enabled() and _flag(NORM_MM_ENV, "0") and cuda_matmul.norm_order_known()


def norm_mm_rows() -> int:
    """The most rows whose products norm them in the launch under :func:`norm_mm_enabled`
    (``HF2Q_NORM_MM_ROWS``; default 16)."""
    return _kernel_rows(NORM_MM_ROWS_ENV, 16)


def _kernel_rows(env: str, default: int) -> int:
    """``env`` as a row count of the small-M kernel (at most its :data:`cuda_matmul.MAX_ROWS`;
    a bad value is an error naming the fix), ``default`` when unset."""
    n = _count(env, f"a row count up to {cuda_matmul.MAX_ROWS}")
    if n is None:
        return default
    if n > cuda_matmul.MAX_ROWS:
        raise UsageError(
            f"{env}={n} is more than the kernel's {cuda_matmul.MAX_ROWS} rows: lower it"
        )
    return n


def small_mm_rows() -> int:
    """Rows up to which every product the small-M kernel can compute runs it
    (``HF2Q_SMALL_MM_ROWS``, default :data:`hf2q.kernels.linear.ALWAYS_ROWS`, 128). A DFlash
    verify of S slots has 16 S rows: above this count its large products go to cuBLAS, whose
    rounding differs from the kernel's (a decode step's), so in bf16 greedy DFlash can then part
    from plain decoding where two logits nearly tie (session 16: with 32, the 4-slot rows of the
    4B-shaped pair matched plain batched decoding 0%, with 128 all of them)."""
    return _kernel_rows(SMALL_MM_ROWS_ENV, linear.ALWAYS_ROWS)


def draft_mm_rows() -> int:
    """Block rows up to which a drafter forward's products run the small-M kernel
    (``HF2Q_DRAFT_MM_ROWS``, default :data:`DRAFT_MM_ROWS`); more rows run MLX's matmul where the
    drafter's weights are large (:func:`draft_mm_enabled`)."""
    n = _count(DRAFT_MM_ROWS_ENV, f"a row count up to {cuda_matmul.MAX_ROWS}")
    return DRAFT_MM_ROWS if n is None else min(n, cuda_matmul.MAX_ROWS)


def draft_head_mm_rows() -> int:
    """Block rows up to which a drafter forward's head runs the small-M kernel
    (``HF2Q_DRAFT_HEAD_MM_ROWS``; unset: :data:`DRAFT_HEAD_MM_ROWS` or :func:`draft_mm_rows`,
    the fewer)."""
    n = _count(DRAFT_HEAD_MM_ROWS_ENV, f"a row count up to {cuda_matmul.MAX_ROWS}")
    if n is None:
        return min(DRAFT_HEAD_MM_ROWS, draft_mm_rows())
    return min(n, cuda_matmul.MAX_ROWS)


def draft_mm_enabled(rows: int, largest: int, head: bool = False) -> bool:
    """Whether a drafter forward of ``rows`` block rows runs products whose largest weight has
    ``largest`` elements (its layers', or with ``head`` its head's) through the small-M kernel:
    where :func:`small_mm_enabled`, for small weights or at most :func:`draft_mm_rows` rows
    (:func:`draft_head_mm_rows` for the head)."""
    if not small_mm_enabled():
        return False
    return largest <= linear.SMALL_WEIGHT or rows <= (
        draft_head_mm_rows() if head else draft_mm_rows()
    )


def mm_key() -> tuple[bool, int, bool | tuple, bool | str]:
    """The settings a compiled runner's products depend on, for the caches of traced functions:
    (:func:`grouped_mm_enabled`, :func:`small_mm_rows`, the single products' layout:
    :func:`mm_columns_enabled`, paired with ``"narrow"`` under ``HF2Q_MM_NARROW=1`` and with
    ``"cols64"`` under ``HF2Q_MM_COLS64`` and with ``"swiglu"`` and its row limit under
    ``HF2Q_MM_SWIGLU=1``, with ``"norm"`` and its row limit under ``HF2Q_NORM_MM=1``,
    :func:`small_qmm_enabled` or with it ``HF2Q_QMM_LAUNCH`` where set)."""
    qmm = small_qmm_enabled() and (os.environ.get(cuda_matmul.QMM_LAUNCH_ENV, "") or True)
    columns: bool | tuple = mm_columns_enabled()
    if cuda_matmul.narrow_enabled():  # a layout of its own, whether or not columns split
        columns = (columns, "narrow")
    if (cols := cuda_matmul.cols64()) is not None:  # four m-tiles' column split
        columns = (columns, "cols64", cols)
    if mm_swiglu_enabled():  # the MLP's launches
        columns = (columns, "swiglu", mm_swiglu_rows())
    if norm_mm_enabled():  # the layers' norms in their products' launches
        columns = (columns, "norm", norm_mm_rows())
    return grouped_mm_enabled(), small_mm_rows(), columns, qmm


def row_attention_enabled() -> bool:
    """Whether the compiled attention runners (plain decoding and verify alike) attend with
    hf2q's row-invariant kernel (:mod:`hf2q.kernels.cuda_attention`), so that in bf16/fp16 a
    verify row and the decode step it stands for give the same bits: on CUDA unless
    ``HF2Q_KERNELS=ops`` or ``HF2Q_ROW_ATTENTION=0``; never elsewhere (CUDA-only kernel)."""
    return _cuda_kernel_switch(ROW_ATTENTION_ENV)


def gdn_window_enabled() -> bool:
    """Whether the fused Gated-DeltaNet kernel also writes a block's conv window (the conv rows
    before it, then its rows: the record a rollback reads and the next conv state's source) in
    its own launch, instead of a concatenate in every layer of every step (``HF2Q_GDN_WINDOW``,
    default on; same values either way: the window is a copy)."""
    return _flag(GDN_WINDOW_ENV, "1")


def gated_norm_enabled() -> bool:
    """Whether the fused Gated-DeltaNet kernel's layers compute their gated norm in one launch
    (``HF2Q_GATED_NORM``, default on; same bits as mlx-lm's two; CUDA only, not with
    ``HF2Q_KERNELS=ops``)."""
    return _cuda_kernel_switch(GATED_NORM_ENV)


def attn_gate_enabled() -> bool:
    """Whether the row-invariant attention launch applies Qwen3.5's output gate in its store
    (``HF2Q_ATTN_GATE``, default off; same bits as mlx-lm's multiply after it)."""
    return _flag(ATTN_GATE_ENV, "0")


def norm_rope_enabled() -> bool:
    """Whether attention layers' query/key norms and RoPE run as one launch each on the kernel
    path (``HF2Q_NORM_ROPE``, default off; same bits as mlx-lm's ops)."""
    return _flag(NORM_ROPE_ENV, "0")


def trace_key() -> tuple[bool, bool, bool, bool]:
    """The kernel settings a layer's trace reads on CUDA besides its products' (:func:`mm_key`):
    :func:`gdn_window_enabled`, :func:`gated_norm_enabled`, :func:`attn_gate_enabled` and
    :func:`norm_rope_enabled`; a kept trace is rebuilt when they change."""
    return gdn_window_enabled(), gated_norm_enabled(), attn_gate_enabled(), norm_rope_enabled()


def kv_row_scatter() -> bool:
    """Whether a lagged one-row slot cache writes by scatter (``HF2Q_KV_ROW_SCATTER``, default on
    CUDA only) instead of a slice update at a device offset; the same values either way."""
    return _flag(KV_ROW_SCATTER_ENV, "1" if backend() == "cuda" else "0")


def draft_ahead_enabled() -> bool:
    """Whether synchronous batched rounds queue the next round's drafter before reading
    their own acceptance (``HF2Q_DRAFT_AHEAD``).

    Default on CUDA: on an H200 (docs/BENCHMARKS.md, session 31, run 1) ``hf2q bench``'s demo
    workload alternating in one process gave 8185 against 7120 tok/s at 8 slots (rounds 4.21
    against 4.84 ms; 1.65x against 1.44x plain batched decoding) and 1627 against 1601 at one
    slot, same tokens and acceptance. Off elsewhere: MLX's CPU ``async_eval`` computes before it
    returns, so there is nothing to overlap (here 30.0 against 30.7 tok/s at one slot). Timed
    on greedy rounds only; sampled rounds (session 31) move the same drafter work before the
    read, plus drawing each row's draft, which a synchronous round does after it.
    """
    return _flag(DRAFT_AHEAD_ENV, "1" if backend() == "cuda" else "0")


def rollback_kernel_enabled() -> bool:
    """Whether a verify's Gated-DeltaNet rollback copies every layer's kept conv rows and state
    in one launch (:mod:`hf2q.kernels.cuda_rollback`, bit-exact copies) instead of a few ops per
    layer: on CUDA unless ``HF2Q_KERNELS=ops`` or ``HF2Q_ROLLBACK_KERNEL=0``; never elsewhere."""
    return _cuda_kernel_switch(ROLLBACK_KERNEL_ENV)


def round_words_enabled() -> bool:
    """Whether a lagged round's outcome is read as 8-byte words (:mod:`hf2q.kernels.cuda_readback`):
    on CUDA unless ``HF2Q_KERNELS=ops`` or ``HF2Q_ROUND_WORDS=0``; never elsewhere.

    Why: MLX's CUDA backend moves a larger array to managed memory with a synchronous copy on
    its first host read, and that copy waits for the graph the device is running; the words are
    allocated there. One-slot trace of the 4B-shaped pair on an H100 (session 47): the drafts'
    copy held the host 1.38 ms a round. Alternating in one process there, lagged rounds went
    from 7.13 to 6.51 ms at one slot (now bound by the device) and from 10.13 to 9.53 ms at four;
    tokens equal. Synchronous rounds (lookup, drafts queued ahead) and plain batched decoding
    from 3 rows read words too; not timed yet.
    """
    return _cuda_kernel_switch(ROUND_WORDS_ENV)


def accept_kernel_enabled() -> bool:
    """Whether greedy rounds take their acceptance from one launch (``HF2Q_ACCEPT_KERNEL``,
    default off; CUDA only, not with ``HF2Q_KERNELS=ops``)."""
    return _cuda_kernel_switch(ACCEPT_KERNEL_ENV, "0")


def host_pieces_enabled() -> bool:
    """Whether rounds join their small host-made integer arrays from pieces of at most 8 bytes
    (``HF2Q_HOST_PIECES``; default on CUDA only, 1 forces it anywhere).

    Why: MLX's CUDA backend may give a new host array of more than 8 bytes a freed device buffer
    of its size, which it first moves to managed memory with a synchronous copy that waits for
    the graph the device is running; arrays of up to 8 bytes come from managed memory. In
    session 47's 4- and 8-slot traces on an H100 one such array a round (the acceptance's draft
    limits, since made once) cost 2.5 and 6.5 ms of host time a round and left the device idle.
    """
    return _flag(HOST_PIECES_ENV, "1" if backend() == "cuda" else "0")


def replay_layers_enabled() -> bool:
    """Whether a final-state record's rollback replays every Gated-DeltaNet layer in one launch
    (:func:`hf2q.kernels.gdn.replay_layers`): on CUDA unless ``HF2Q_KERNELS=ops`` or
    ``HF2Q_REPLAY_LAYERS=0``; never elsewhere."""
    return _cuda_kernel_switch(REPLAY_LAYERS_ENV)


def gdn_record(record_bytes: int = 0) -> str:
    """What a verify through the runners keeps for the rollback: ``"states"`` (the state after
    every position, restored by a copy, on CUDA for all layers in one launch) or ``"final"`` (the
    last state only; the rollback replays each row's kept steps from the state before the
    verify, the same bits). ``HF2Q_GDN_RECORD`` picks one; unset, the final state where one
    layer's per-step record would take ``record_bytes`` >= :data:`GDN_FINAL_MIN_BYTES`. Why
    both: the per-step record writes a float32 state per row, step and layer (1.41 ms of a
    4-slot round of the 4B-shaped pair on an H200, 2.85 ms at 8 slots, session 22), while the
    replay reruns the kept steps (one launch for every layer since session 45), which cost more
    than the copy for small models (session 23) and, before the joined launch, at one row. The
    layer-call verify (CPU, Apple GPUs) always keeps per-step states."""
    value = os.environ.get(GDN_RECORD_ENV, "").strip().lower()
    if not value:
        return "final" if record_bytes >= GDN_FINAL_MIN_BYTES else "states"
    if value not in ("states", "final"):
        raise UsageError(
            f"{GDN_RECORD_ENV}={value!r} must be 'states' or 'final': unset it or fix it"
        )
    return value


def _cuda_kernel_switch(env: str, default: str = "1") -> bool:
    """A CUDA-only kernel's switch: ``env`` (``default`` on; a bad value is an error on every
    backend), and only on CUDA unless ``HF2Q_KERNELS=ops``."""
    return _flag(env, default) and backend() == "cuda" and kernel_mode() != "ops"


def prefill_runners_enabled() -> bool:
    """Whether a prompt's chunks run through the compiled layer runners on CUDA.

    Why: prefill runs the model's own layer calls, and off Apple GPUs mlx-lm computes the
    Gated-DeltaNet recurrence of a chunk as a Python loop of small ops per step (a 1024-token
    prompt of a Qwen3.5-4B shape is about 640 thousand graph nodes and 1.5 s on an H200,
    docs/BENCHMARKS.md, session 15); the runners run it as one fused kernel per layer.
    On where plain decoding runs the runners (CUDA) unless ``HF2Q_PREFILL_RUNNERS=0``: measured
    on an H200 (session 16), 26x faster for a 1024-token prompt of that shape and 38x for 4096.
    """
    return _flag(PREFILL_RUNNERS_ENV, "1")


def lagged_rounds_enabled() -> bool:
    """Whether DFlash without lookup (single or batched, greedy or sampled) queues each round
    before reading the last one's acceptance (``HF2Q_LAGGED_ROUNDS``).

    Default on CUDA, where ``mx.async_eval`` returns once the graph is encoded, so the host
    builds round k+1 while the device computes round k: on an H200 (docs/BENCHMARKS.md, session
    17) the single-sequence round of the 4B-shaped pair was 8-9% shorter, alternating in one
    process (E 0.516 -> 0.570 and 0.562 -> 0.624, tokens equal plain decoding's), and its GPU
    tests passed. Off elsewhere: MLX's CPU ``async_eval`` computes before it returns, leaving
    nothing to overlap (slower here, session 16); Apple GPUs are untested.
    """
    return _flag(LAGGED_ROUNDS_ENV, "1" if backend() == "cuda" else "0")


def lag_depth() -> int:
    """Lagged rounds kept in flight (``HF2Q_LAG_DEPTH``, 2 unless set; 2 to 4): the host reads
    a round's acceptance once this many rounds are queued. Same tokens at any depth; a deeper
    queue computes more rounds past a finished row."""
    raw = os.environ.get(LAG_DEPTH_ENV, "").strip()
    if not raw:
        return 2
    if raw not in ("2", "3", "4"):
        raise UsageError(f"{LAG_DEPTH_ENV}={raw!r} must be 2, 3 or 4: fix or unset it")
    return int(raw)


def lagged_lookup_enabled() -> bool:
    """Whether lookup drafting (``lookup=True``) keeps lagged rounds where they are on
    (``HF2Q_LAGGED_LOOKUP=1``): a lookup proposal needs the sequence's latest tokens, so the
    rounds turn synchronous while any sequence's lookup proposal is due
    (``LookupChooser.proposal``) and lagged again when none is. Off by default: slower on the
    H200 too (docs/BENCHMARKS.md, session 18: the demo pair's looping prompt, DFlash 0.468 ms a
    token with synchronous lookup rounds against 0.579 with this, alternating in one process)."""
    return lagged_lookup_mode() != "0"


def lagged_lookup_mode() -> str:
    """``HF2Q_LAGGED_LOOKUP`` as one of :data:`LAGGED_LOOKUP_MODES` (``0``: lookup rounds are
    synchronous; ``1``: lagged while no proposal is due; ``device``: batched greedy rounds take
    their proposals from the device and stay lagged). Default ``0``: on an H200 the demo pair's
    ``device`` rounds were 14-18% longer at 1 and 8 slots, same rounds and tokens
    (docs/BENCHMARKS.md, session 29: the drafter runs in every lagged round, and the host, which
    lagging does not relieve, bounds the round)."""
    raw = os.environ.get(LAGGED_LOOKUP_ENV, "0").strip().lower() or "0"
    value = {"false": "0", "off": "0", "true": "1", "on": "1"}.get(raw, raw)
    if value not in LAGGED_LOOKUP_MODES:
        raise UsageError(
            f"{LAGGED_LOOKUP_ENV}={raw!r} is not one of {', '.join(LAGGED_LOOKUP_MODES)}: "
            "unset it or pick one"
        )
    return value


def lagged_draft_first() -> bool:
    """Whether a lagged round (:func:`lagged_rounds_enabled`) queues its draft before building
    its verify (``HF2Q_LAGGED_DRAFT_FIRST``, default on; the values are the same either way).

    Why: a kernel trace of the 4B-shaped pair's lagged rounds on an H200 (docs/BENCHMARKS.md,
    session 22, ``benchmarks/gpu_timeline.py``) found the device idle 2.0 ms a round at one slot
    and 3-4 ms at four between one round's last kernel and the next round's first: the host
    built a whole round (draft, verify, acceptance, rollback) in Python before it queued any of
    it. Queuing the draft first lets the device draft while the host builds the verify (and the
    verify's layers queued as they are built, :func:`flush_layers`, let it verify meanwhile):
    8.24 -> 7.55 ms a round at one slot, 12.66 -> 12.50 at four, alternating in one process.
    """
    return _flag(LAGGED_DRAFT_FIRST_ENV, "1")


def lagged_for(lookup: bool) -> bool:
    """Whether DFlash rounds are lagged by default: :func:`lagged_rounds_enabled`, and with
    lookup also :func:`lagged_lookup_enabled`."""
    return lagged_rounds_enabled() and (not lookup or lagged_lookup_enabled())


def compile_forward_enabled() -> bool:
    """Whether plain decoding steps may run as one compiled graph (``HF2Q_COMPILE_FORWARD``):
    default on CUDA, where the layer runners run. On an H200 (docs/BENCHMARKS.md, session 38)
    the 4B-shaped bf16 step took 4.30 against 5.09 ms after 64 prompt tokens and 4.47 against
    5.02 after 1024, alternating in one process, the same tokens; the device's work is the
    same, the host builds the step in 0.85 ms instead of 1.9. Unset, plain decoding takes it
    only where its bits equal the layer path's (:meth:`hf2q.kernels.forward.CompiledDecode.exact`);
    ``1`` forces it wherever it runs (:func:`compile_forward_forced`), ``0`` turns it off."""
    return _flag(COMPILE_FORWARD_ENV, "1" if backend() == "cuda" else "0")


def compile_forward_forced() -> bool:
    """Whether ``HF2Q_COMPILE_FORWARD`` is set on (not just on by default): plain decoding then
    runs the compiled step even where its attention is MLX's over the whole masked buffer,
    whose bits need not equal the layer path's (float32 on CUDA, session 38)."""
    return compile_forward_enabled() and COMPILE_FORWARD_ENV in os.environ


def compile_verify_enabled() -> bool:
    """Whether a verify forward of full blocks may run as one compiled graph
    (``HF2Q_COMPILE_VERIFY``; default on CUDA, where the layer runners run). Unset, only where
    its bits equal the layer path's (the row-invariant attention kernel,
    :meth:`hf2q.kernels.forward.CompiledVerify.exact`); ``1`` forces it wherever it runs
    (:func:`compile_verify_forced`), ``0`` turns it off. Why: the round of a model the size of
    Qwen3.5-4B on an H200 waits for the host building the verify's graph layer by layer (about
    100 us of Python a layer, docs/BENCHMARKS.md session 28); one compiled graph is replayed
    from C++ instead, as the plain step's (1.91 against 0.85 ms to build, session 38)."""
    return _flag(COMPILE_VERIFY_ENV, "1" if backend() == "cuda" else "0")


def compile_verify_forced() -> bool:
    """Whether ``HF2Q_COMPILE_VERIFY`` is set on (not just on by default): the verify then runs
    as one graph even where its attention is MLX's over the whole masked buffer."""
    return compile_verify_enabled() and COMPILE_VERIFY_ENV in os.environ


def compile_draft_enabled() -> bool:
    """Whether the drafter's forward of a full block may run as one compiled graph
    (``HF2Q_COMPILE_DRAFT``; default on CUDA, off elsewhere; 0 or 1 forces it). Why: a round
    waits for the host, and the drafter's forward is built layer by layer (its compiled pieces,
    cache writes and attention called from Python per layer), where one compiled graph is
    replayed from C++ (as the verify's). On an H100 (docs/BENCHMARKS.md session 45, the setting
    alternating in one process, tokens equal) it gave the demo pair 16% more tok/s at one slot,
    35% at four and 10% at eight (1.62x -> 1.78x plain decoding), and the 4B-shaped pair's
    rounds 3.4% shorter at one slot and 9% at four. Its drafts are the layer path's where
    products are row-invariant, and the target decides the output whatever the drafts are."""
    return _flag(COMPILE_DRAFT_ENV, "1" if backend() == "cuda" else "0")


def flush_layers(lagged: bool = False) -> int:
    """After how many layers a verify forward queues what it has built (0: never):
    ``HF2Q_FLUSH_LAYERS`` when set, else :data:`LAGGED_FLUSH_LAYERS` in a lagged round
    (``lagged``) and 0 in a synchronous one.

    Why: for a model the size of Qwen3.5-4B on an H200 a DFlash round is bound by the host (the
    verify's graph takes milliseconds of Python to build, then its evaluation encodes it), so
    queuing the graph every few layers (``mx.async_eval``; the values are the same) lets the
    device work while the host builds the rest. In synchronous rounds it gave no gain (every 8
    layers) or a loss (every 4): docs/BENCHMARKS.md, "H200, session 15". In lagged rounds, with
    the draft queued first (:func:`lagged_draft_first`), every 8 layers shortened the 4B-shaped
    pair's round from 8.24 to 7.11 ms at one slot and from 12.66 to 11.13 ms at four (session
    22, alternating in one process, tokens equal); every 4 layers was within 2% of every 8,
    every 16 slower. The verify graph (:func:`compile_verify_enabled`) cannot be cut by layers:
    where this is not 0 it is queued whole as soon as it is built, before the acceptance and the
    rollback: on an H100 (session 46, alternating in one process, tokens equal) the 4B-shaped
    pair's 4-slot round went from 11.36 to 10.40 ms; at one slot 7.11 against 7.17 ms, no gain
    (so the device's 1.1 ms idle there is not the time the acceptance and rollback take to build).
    """
    value = _count(FLUSH_LAYERS_ENV, "a layer count")
    if value is None:
        return LAGGED_FLUSH_LAYERS if lagged else 0
    return value


def sdpa_bucket() -> int | None:
    """Key-length bucket for attention over more than one query (verify, drafting), or None.

    On MLX's CUDA backend a half-precision ``scaled_dot_product_attention`` with several queries
    runs cuDNN, which builds and caches one execution graph per (query length, key length): a
    DFlash round attends over a context one round longer than the last, so every round built new
    graphs (about 40 ms a round on an H200, far more than the round's compute) and the cache's
    256 entries thrash under several slots. Padding the keys to a multiple of this bucket (the
    padding masked out) keeps the key length, hence the graph, the same for a bucket's worth of
    rounds. ``HF2Q_SDPA_BUCKET``: a positive multiple to force it anywhere, 0 to turn it off;
    default 256 on CUDA, off elsewhere (CPUs and Apple GPUs build nothing per shape).
    """
    value = _count(SDPA_BUCKET_ENV, "a positive bucket length")
    if value is not None:
        return value or None
    return SDPA_BUCKET_CUDA if backend() == "cuda" else None


def bucketed(n: int, bucket: int | None) -> int:
    """``n`` rounded up to a multiple of ``bucket`` (``n`` itself without a bucket)."""
    return n if not bucket else -(-n // bucket) * bucket


def kernel_mode() -> str:
    """The requested mode from ``HF2Q_KERNELS`` (default ``auto``)."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise UsageError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}: unset it or pick one")
    return mode


def backend() -> str:
    """``"cuda"``, ``"metal"`` or ``"cpu"``: where MLX's default device computes."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


def _cuda_shapes_ok(*, Dk: int, Dv: int, Hk: int, Hv: int, T: int) -> str | None:
    from hf2q.kernels.cuda_gated_delta import UnsupportedShape, check_shapes

    try:
        check_shapes(Dk=Dk, Dv=Dv, Hk=Hk, Hv=Hv, T=T)
    except UnsupportedShape as exc:
        return str(exc)
    return None


def recurrence_impl(q: mx.array, v: mx.array, state: mx.array) -> str:
    """``"cuda"`` or ``"ops"`` for ``gated_delta_steps(q, k, v, g, beta, state)`` on these inputs."""
    mode = kernel_mode()
    if mode == "ops":
        return "ops"
    problem = None
    if backend() != "cuda":
        problem = f"MLX computes on {backend()}, not CUDA"
    elif state.dtype != mx.float32:
        problem = "the recurrent state is not float32"
    else:
        problem = _cuda_shapes_ok(
            Dk=q.shape[-1], Dv=v.shape[-1], Hk=q.shape[2], Hv=v.shape[2], T=q.shape[1]
        )
    if problem is None:
        return "cuda"
    if mode == "cuda":
        raise UsageError(f"{ENV}=cuda but the CUDA recurrence cannot run: {problem}; unset {ENV}")
    return "ops"


def gdn_impl(attn: object) -> str:
    """Implementation for :func:`hf2q.kernels.gdn.gdn_mixer` on this machine for this layer."""
    mode = kernel_mode()
    if mode == "ops":
        return "ops"
    where = backend()
    if where == "cuda":
        problem = _cuda_shapes_ok(
            Dk=attn.head_k_dim, Dv=attn.head_v_dim, Hk=attn.num_k_heads, Hv=attn.num_v_heads, T=1
        )
        if problem is None:
            return "cuda"
        if mode == "cuda":
            raise UsageError(
                f"{ENV}=cuda but the fused CUDA kernel cannot run: {problem}; unset {ENV}"
            )
        return "ops"
    if mode == "cuda":
        raise UsageError(
            f"{ENV}=cuda but MLX computes on {where}: unset {ENV} or run on an NVIDIA GPU"
        )
    return "mlx" if where == "metal" else "ops"


def gated_delta_steps(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """``(y, states)`` of the gated delta rule over T steps, on the fastest implementation here.

    Shapes: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, Dv, Dk)
    float32. Returns y (B, T, Hv, Dv) in q's dtype and the state after each step
    (B, T, Hv, Dv, Dk) float32.
    """
    if recurrence_impl(q, v, state) == "cuda":
        from hf2q.kernels.cuda_gated_delta import gated_delta_steps_cuda

        return gated_delta_steps_cuda(q, k, v, g, beta, state, record="states")
    from hf2q.kernels.gdn import gated_delta_steps_ops

    return gated_delta_steps_ops(q, k, v, g, beta, state, record="states")


def describe(attn: object | None = None) -> dict[str, str]:
    """What runs where, for ``--stats`` and benchmark records.

    Args:
        attn: a ``GatedDeltaNet`` module of the model (its head sizes decide CUDA support);
            without it only the device-level choice is reported.
    """
    info = {"backend": backend(), "mode": kernel_mode()}
    runners = info["backend"] == "cuda" and info["mode"] != "ops"  # where decoding runs them
    if attn is not None:
        impl = gdn_impl(attn)
        info["gdn_mixer"] = {
            "cuda": "fused CUDA kernel (conv+silu+norm+gates+recurrence"
            + (", writing the conv window" if gdn_window_enabled() else "")
            + ("; gated norm in one launch)" if gated_norm_enabled() else ")"),
            "mlx": "mlx-lm gated_delta_update (Metal kernel)",
            "ops": "ops (portable)",
        }[impl]
        # What the runtime's verify records (hf2q.runtime.verify): HF2Q_GDN_RECORD where the
        # compiled runners verify (hf2q.runtime.verify.use_runners), per-step states elsewhere.
        one = rollback_kernel_enabled()
        states = "states" + (" (one launch for all layers)" if one else "")
        final = (
            "final state (kept steps replayed per row"
            + (", every layer in one launch" if replay_layers_enabled() else "")
            + (", kept conv rows in one launch)" if one else ")")
        )
        if not (runners and compile_enabled()):
            info["gdn_record"] = "states"
        elif gdn_record(0) == gdn_record(GDN_FINAL_MIN_BYTES):
            info["gdn_record"] = final if gdn_record() == "final" else states
        else:
            mib = GDN_FINAL_MIN_BYTES >> 20
            info["gdn_record"] = f"{final} from {mib} MiB of per-step states a layer, else {states}"
    info["recurrence"] = "CUDA kernel" if runners else "ops"
    info["compile"] = "on" if compile_enabled() else "off"
    if fuse_proj_enabled():
        info["projections"] = "concatenated"
    info["small_mm"] = (
        f"tensor-core kernel up to {small_mm_rows()} rows ({cuda_matmul.MAX_ROWS} for small weights)"
        if small_mm_enabled()
        else "MLX matmul"
    )
    if grouped_mm_enabled():
        info["small_mm"] += ", products sharing an input in one launch"
    if mm_swiglu_enabled():
        info["small_mm"] += ", the MLP's SwiGLU in its gate/up launch"
        if mm_swiglu_rows() < cuda_matmul.MAX_ROWS:
            info["small_mm"] += f" (up to {mm_swiglu_rows()} rows)"
    if norm_mm_enabled():
        info["small_mm"] += (
            f", layers' norms in their products' launches (up to {norm_mm_rows()} rows)"
        )
    elif grouped_mm_enabled() and _flag(NORM_MM_ENV, "0"):
        info["small_mm"] += (
            f", layers' norms not in the launches: MLX {mx.__version__} may sum them in another"
            f" order (checked: {', '.join(cuda_matmul.NORM_ORDER_MLX)})"
        )
    if mm_columns_enabled():
        info["small_mm"] += ", columns split at 33-64 rows"
    if small_mm_enabled() and mm_columns_enabled() and (cols := cuda_matmul.cols64()) is not None:
        info["small_mm"] += (
            f", 49-64 rows of {cuda_matmul.COLS64_MIN_COLUMNS}+ columns split over {cols[1]}"
            f" warps of {8 * cols[0]} columns, loaded {cols[2]} chunks ahead"
        )
    if small_qmm_enabled():
        info["small_mm"] += ", 4/8-bit affine layers dequantized in the kernel"
    if small_mm_enabled() and draft_mm_rows() < cuda_matmul.MAX_ROWS:
        info["small_mm"] += (
            f"; large drafters' drafts of more than {draft_mm_rows()} rows: MLX matmul"
        )
    info["attention"] = (
        "row-invariant kernel (bf16/fp16)" if row_attention_enabled() else "MLX attention"
    )
    if row_attention_enabled() and attn_gate_enabled():
        info["attention"] += ", output gate in its store"
    if row_attention_enabled() and norm_rope_enabled():
        info["attention"] += ", q/k norm and RoPE in one launch each"
    info["prefill"] = (
        "compiled runners" if runners and prefill_runners_enabled() else "the model's layers"
    )
    if runners and compile_forward_enabled():
        info["decode_step"] = (
            "one compiled graph"
            if compile_forward_forced()
            else "one compiled graph where attention is the row-invariant kernel"
        )
    if runners and compile_verify_enabled():
        info["verify_graph"] = (
            "one compiled graph (full blocks)"
            if compile_verify_forced()
            else "one compiled graph (full blocks) where attention is the row-invariant kernel"
        )
    if compile_draft_enabled():
        info["draft_graph"] = "one compiled graph (full blocks)"
    if lagged_rounds_enabled():
        info["rounds"] = (
            "lagged (with lookup: synchronous while a lookup draft is due)"
            if lagged_lookup_enabled()
            else "lagged (without lookup)"
        )
        if lagged_draft_first():
            info["rounds"] += ", draft queued first"
    if draft_ahead_enabled():
        info["draft_ahead"] = "synchronous batched rounds"
    if round_words_enabled():
        info["round_reads"] = "8-byte words packed in one launch"
    if accept_kernel_enabled():
        info["acceptance"] = "greedy: one launch"
    if host_pieces_enabled():
        info["host_arrays"] = "joined from 8-byte pieces"
    flush = flush_layers(lagged_rounds_enabled())  # (lagged rounds queue their verify early)
    info["verify_queue"] = f"every {flush} layers" if flush else "at the acceptance"
    bucket = sdpa_bucket()
    info["sdpa_keys"] = f"padded to a multiple of {bucket}" if bucket else "exact length"
    return info


def summary(model: object | None = None) -> str:
    """:func:`describe` as one line for ``--stats`` (``model``: an mlx-lm model or TargetModel)."""
    attn = None
    layers = getattr(model, "layers", None) or []
    for layer in layers:
        if getattr(layer, "is_linear", False):
            attn = layer.linear_attn
            break
    info = describe(attn)
    parts = [info["backend"]]
    if "gdn_mixer" in info:
        parts.append(f"Gated-DeltaNet {info['gdn_mixer']}, rollback {info['gdn_record']}")
    parts.append(f"compile {info['compile']}")
    if "projections" in info:
        parts.append(f"projections {info['projections']}")
    parts.append(f"small products {info['small_mm']}")
    parts.append(f"attention {info['attention']}, keys {info['sdpa_keys']}")
    parts.append(f"verify queued {info['verify_queue']}")
    parts.append(f"prefill through {info['prefill']}")
    if "decode_step" in info:
        parts.append(f"decode step {info['decode_step']}")
    if "verify_graph" in info:
        parts.append(f"verify {info['verify_graph']}")
    if "draft_graph" in info:
        parts.append(f"draft {info['draft_graph']}")
    if "rounds" in info:
        parts.append(f"rounds {info['rounds']}")
    if "draft_ahead" in info:
        parts.append(f"next draft queued ahead ({info['draft_ahead']})")
    if "round_reads" in info:
        parts.append(f"round outcomes read as {info['round_reads']}")
    if "host_arrays" in info:
        parts.append(f"small host-made arrays {info['host_arrays']}")
    if info["mode"] != "auto":
        parts.append(f"{ENV}={info['mode']}")
    return "; ".join(parts)
