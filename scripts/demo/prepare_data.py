"""Build the demo corpus, its tokenizer and the tokenized splits from this machine's Python stdlib.

What it does, deterministically (no randomness at all; the same Python version gives the same
bytes out):

1. collects every ``*.py`` file of the standard library of the Python running this script
   (``sysconfig.get_paths()['stdlib']``), excluding ``site-packages``; ``test/`` is included (it is
   ordinary Python and doubles the corpus); files that are not UTF-8 and files over 400 kB (only
   ``pydoc_data/topics.py``, a documentation blob) are left out;
2. holds out whole files for evaluation: a file is held out when the first 8 hex digits of the
   SHA-256 of its relative path, modulo 100, are below ``--heldout-percent``;
3. trains a byte-level BPE tokenizer (HF ``tokenizers``) on the training split only, with the
   special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at ids 0, 1, 2, and saves it
   as a transformers tokenizer (tokenizer.json, tokenizer_config.json) plus generation_config.json;
   the model's embedding has ``--embedding-rows`` rows, more than the tokenizer's vocabulary, so the
   first row past the vocabulary is free to serve as the DFlash MASK token;
4. writes the splits as JSONL records ``{"path", "text"}`` into ``--text-out`` (what
   ``hf2q train-draft --data`` reads) and, into ``--out``, one uint16 token stream per split
   (``train.npy``, ``heldout.npy``: files joined by ``<|endoftext|>``; with the tokenizer about
   18 MB, small enough to carry to a GPU machine) and a ``manifest.json`` with the Python version, every file's relative path,
   size and SHA-256, the split, token counts and the tokenizer's hash.

What it does not do: train any model (``train_target.py``) or download anything.

Usage: ``python scripts/demo/prepare_data.py --out runs/demo/data``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
import time
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_FILE_BYTES = 400_000


def stdlib_files(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's Python files, sorted by path; see the module doc."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/__pycache__/" in rel:
            continue
        data = p.read_bytes()
        if len(data) > MAX_FILE_BYTES or not data.strip():
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((rel, text))
    return out


def is_heldout(rel: str, percent: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < percent


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> dict[str, int]:
    """Train the byte-level BPE on ``texts`` and save it as a transformers tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    # A raw-text (base) model: no chat template is shipped on purpose.
    fast.model_max_length = 32768
    fast.save_pretrained(str(out))
    # Name the class every transformers release knows (5.x would write its own alias).
    cfg_file = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]], "pad_token_id": 0},
            indent=2,
        )
        + "\n"
    )
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("runs/demo/data"), help="tokenizer + token streams"
    )
    ap.add_argument(
        "--text-out", type=Path, default=Path("runs/demo/text"), help="the splits as JSONL"
    )
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--heldout-percent", type=int, default=6)
    ap.add_argument("--vocab-size", type=int, default=8000, help="tokenizer vocabulary")
    ap.add_argument(
        "--embedding-rows", type=int, default=8192, help="model embedding rows (> vocab)"
    )
    args = ap.parse_args(argv)
    if args.embedding_rows <= args.vocab_size:
        ap.error("--embedding-rows must exceed --vocab-size (a spare row serves as MASK)")

    import numpy as np

    t0 = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(args.stdlib)
    train = [(r, t) for r, t in files if not is_heldout(r, args.heldout_percent)]
    held = [(r, t) for r, t in files if is_heldout(r, args.heldout_percent)]

    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    special = train_tokenizer([t for _, t in train], args.vocab_size, tok_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = special["<|endoftext|>"]

    stats = {}
    for name, split in (("train", train), ("heldout", held)):
        encs = tok.encode_batch([t for _, t in split], add_special_tokens=False)
        lengths = [len(e.ids) for e in encs]
        stream = []
        for e in encs:
            stream.extend(e.ids)
            stream.append(eot)
        arr = np.asarray(stream, dtype=np.uint16)
        np.save(out / f"{name}.npy", arr)
        args.text_out.mkdir(parents=True, exist_ok=True)
        with open(args.text_out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for rel, text in split:
                f.write(json.dumps({"path": rel, "text": text}) + "\n")
        stats[name] = {
            "files": len(split),
            "bytes": sum(len(t.encode()) for _, t in split),
            "tokens": int(arr.size),
            "file_tokens": dict(zip([r for r, _ in split], lengths)),
        }

    tok_hash = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    manifest = {
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "stdlib": str(args.stdlib),
        "rules": {
            "included": "*.py under the stdlib, test/ included, site-packages excluded",
            "excluded": f"non-UTF-8 files, empty files, files over {MAX_FILE_BYTES} bytes",
            "heldout": f"int(sha256(relpath)[:8], 16) % 100 < {args.heldout_percent}",
        },
        "tokenizer": {
            "type": "byte-level BPE (HF tokenizers), trained on the train split",
            "vocab_size": vocab,
            "embedding_rows": args.embedding_rows,
            "special_ids": special,
            "first_unused_row": vocab,
            "sha256": tok_hash,
        },
        "splits": {
            k: {kk: vv for kk, vv in v.items() if kk != "file_tokens"} for k, v in stats.items()
        },
        "files": [
            {
                "path": rel,
                "split": "heldout" if is_heldout(rel, args.heldout_percent) else "train",
                "bytes": len(text.encode()),
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "tokens": stats["heldout" if is_heldout(rel, args.heldout_percent) else "train"][
                    "file_tokens"
                ][rel],
            }
            for rel, text in files
        ],
        "seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    s = manifest["splits"]
    print(
        f"python {platform.python_version()}: {s['train']['files']} train files "
        f"({s['train']['tokens']:,} tokens), {s['heldout']['files']} held-out files "
        f"({s['heldout']['tokens']:,} tokens), vocab {vocab}, "
        f"{s['train']['bytes'] / max(1, s['train']['tokens']):.2f} bytes/token, "
        f"{manifest['seconds']} s -> {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
