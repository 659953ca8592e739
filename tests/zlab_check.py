"""Check a drafter folder with z-lab's own loader (``dflash.model_mlx.load_draft``), in a subprocess.

z-lab's loader only takes Hub ids (it calls ``snapshot_download``), so the folder is placed in a
private Hub cache and read offline, as a downloaded drafter would be. The subprocess then drafts
one block with z-lab's model and with hf2q's, bound to the same target, and compares the logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import checkpoints as ck

_SCRIPT = """
import mlx.core as mx, numpy as np
from dflash.model_mlx import load_draft
from hf2q.loading import load_model
from hf2q.runtime.drafter import load_drafter
from hf2q.runtime.target import TargetModel

loaded = load_model({target!r})
target = TargetModel(loaded.model)
theirs = load_draft({repo!r}).bind(loaded.model)
ours = load_drafter({draft!r}).bind(target.embed, target.head)
assert theirs.config.target_layer_ids == tuple(ours.config.target_layer_ids)
assert theirs.config.mask_token_id == ours.config.mask_token_id
assert theirs.config.block_size == ours.config.block_size
B = ours.config.block_size
tokens = mx.array([[5, 17, 33, 9, 60, 2, 77, 41, 8, 12, 99, 3]])
_, feats = target.forward(tokens, capture=ours.config.target_layer_ids)
block = mx.array([[12] + [ours.config.mask_token_id] * (B - 1)])
dt = theirs.fc.weight.dtype
a = theirs(block, feats.astype(dt), theirs.make_cache(), logits_start=1)
b = ours(block, feats.astype(dt), ours.make_cache())
a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
assert a.shape == b.shape == (1, B - 1, target.vocab_size), (a.shape, b.shape)
assert (a.argmax(-1) == b.argmax(-1)).all()
assert np.abs(a - b).max() < 0.05 * np.abs(b).max(), np.abs(a - b).max()
print("ok")
"""


def assert_zlab_loads_like_hf2q(target: Path, draft: Path, tmp: Path) -> None:
    """Raise AssertionError unless z-lab's loader reads ``draft`` and drafts what hf2q drafts."""
    repo = "hf2q-test/dflash-drafter"
    cache = tmp / "hub"
    ck.add_to_hf_cache(cache, repo, draft)
    script = textwrap.dedent(_SCRIPT).format(target=str(target), draft=str(draft), repo=repo)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
