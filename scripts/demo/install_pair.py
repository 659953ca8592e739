"""Copy a trained demo target and drafter into the package (``hf2q/demo/``) and their logs into the repo.

What it does: copies the files a checkpoint needs and nothing else (target: config.json,
generation_config.json, tokenizer files, safetensors shards and index; drafter: config.json and
model.safetensors), checks the pair is at most ``--max-mb`` megabytes, and copies the training
logs (``train_log.json`` of each) to ``scripts/demo/logs/`` together with the data manifest's
summary (Python version, split sizes, tokenizer hash; the per-file list stays in ``runs/``).

What it does not do: train, convert or evaluate (see the other scripts in this folder).

Usage::

    python scripts/demo/install_pair.py --target runs/demo/target --draft runs/demo/draft
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)


def _copy(src: Path, dst: Path, names: list[str]) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy(src / name, dst / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path("runs/demo/data"))
    ap.add_argument("--dest", type=Path, default=ROOT / "hf2q" / "demo")
    ap.add_argument("--logs", type=Path, default=ROOT / "scripts" / "demo" / "logs")
    ap.add_argument("--max-mb", type=float, default=25.0)
    args = ap.parse_args(argv)

    t_names = [n for n in TARGET_FILES if (args.target / n).is_file()]
    t_names += sorted(p.name for p in args.target.glob("*.safetensors"))
    d_names = ["config.json", "model.safetensors"]
    size = sum((args.target / n).stat().st_size for n in t_names)
    size += sum((args.draft / n).stat().st_size for n in d_names)
    if size > args.max_mb * 1e6:
        raise SystemExit(f"the pair is {size / 1e6:.1f} MB, over the {args.max_mb} MB limit")
    _copy(args.target, args.dest / "target", t_names)
    _copy(args.draft, args.dest / "draft", d_names)

    args.logs.mkdir(parents=True, exist_ok=True)
    for name, folder in (("target", args.target), ("draft", args.draft)):
        log = folder / "train_log.json"
        if log.is_file():
            shutil.copy(log, args.logs / f"{name}_train_log.json")
    manifest = json.loads((args.data / "manifest.json").read_text())
    summary = {k: v for k, v in manifest.items() if k != "files"}
    summary["heldout_files"] = [f["path"] for f in manifest["files"] if f["split"] == "heldout"]
    (args.logs / "data_manifest_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"installed the pair ({size / 1e6:.1f} MB) into {args.dest}; logs in {args.logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
