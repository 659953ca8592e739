"""Shared fixtures: tiny checkpoints written once per test session by ``tests/checkpoints.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests never touch the network: the Hub path is exercised against a prepared local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import checkpoints as ck  # noqa: E402


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def qwen35_dir(fixtures_dir: Path) -> Path:
    """Tiny Qwen3_5ForConditionalGeneration (hybrid: 3 Gated-DeltaNet + 1 attention), float32."""
    return ck.build_qwen35(fixtures_dir / "qwen35", seed=0)


@pytest.fixture(scope="session")
def qwen35_causal_dir(fixtures_dir: Path) -> Path:
    """Tiny text-only Qwen3_5ForCausalLM, 8 layers, float32."""
    return ck.build_qwen35(
        fixtures_dir / "qwen35_causal", layout="causal", num_hidden_layers=8, seed=1
    )


@pytest.fixture(scope="session")
def qwen35_moe_dir(fixtures_dir: Path) -> Path:
    """Tiny Qwen3_5MoeForConditionalGeneration, float32."""
    return ck.build_qwen35(fixtures_dir / "qwen35_moe", moe=True, seed=2)


@pytest.fixture(scope="session")
def qwen3_dir(fixtures_dir: Path) -> Path:
    """Tiny plain Qwen3 (pure attention), float32."""
    return ck.build_qwen3(fixtures_dir / "qwen3", seed=3)


@pytest.fixture(scope="session")
def drafter_dir(fixtures_dir: Path) -> Path:
    """Random 1-layer DFlash drafter (z-lab format) for the 4-layer tiny targets."""
    return ck.build_drafter(fixtures_dir / "drafter", layers=1, seed=4)
