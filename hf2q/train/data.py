"""Training data for ``hf2q train-draft``: read, tokenize, hold out, regenerate, batch.

What it does:

* reads ``--data`` paths: text files (any extension, UTF-8; binary files are skipped), folders
  (every file below, sorted), and ``.jsonl`` files whose records are ``{"text": ...}`` (raw text)
  or ``{"messages": [{"role", "content"}, ...]}`` / ShareGPT ``{"conversations": [{"from",
  "value"}, ...]}`` (chat, rendered with the tokenizer's chat template);
* tokenizes them into sequences of at most ``seq_len`` tokens with a loss mask that marks
  response tokens (every token of raw text; the assistant turns of a chat);
* holds out evaluation prompts (raw text: the first tokens of a sequence; chat: the conversation
  up to its first assistant turn, with the generation prompt);
* optionally regenerates the responses with the target itself (:func:`regenerate`), the
  recommended recipe: raw text keeps a prompt of each sequence and lets the target continue it,
  chat keeps the conversation up to the first assistant turn and lets the target answer;
* batches sequences (right-padded to ``seq_len``) in a seeded order, epoch by epoch.

What it does not do: run the drafter or compute the loss (``objective``, ``trainer``).
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hf2q.errors import DataError

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


@dataclass
class Record:
    """One training document: raw ``text`` or chat ``messages``; ``where`` names its origin."""

    where: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class TokenSeq:
    """Token ids (int32) and a loss mask (True: a response token, may be a label)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    prompt_len: int  # tokens before the first response token (0 for raw text)
    chat: bool

    def __len__(self) -> int:
        return int(self.tokens.size)


# ---- reading ------------------------------------------------------------------------------------
def _is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


def _chat_messages(obj: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and all(
            isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in msgs
        )
        if not ok:
            raise DataError(
                f"{where}: 'messages' must be a list of {{role, content}} objects with text content"
            )
        return [{"role": str(m["role"]), "content": m["content"]} for m in msgs]
    if "conversations" in obj:
        conv = obj["conversations"]
        out = []
        for m in conv if isinstance(conv, list) else [None]:
            if not isinstance(m, dict) or m.get("from") not in _SHAREGPT_ROLES:
                raise DataError(
                    f"{where}: 'conversations' turns need 'from' (human/gpt/system) and 'value'"
                )
            out.append({"role": _SHAREGPT_ROLES[m["from"]], "content": str(m.get("value", ""))})
        return out
    return None


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where} is not valid JSON ({exc.msg}): fix or remove that line"
            ) from exc
        if not isinstance(obj, dict):
            raise DataError(f"{where} is not a JSON object: write one object per line")
        msgs = _chat_messages(obj, where)
        if msgs is not None:
            records.append(Record(where, messages=msgs))
        elif isinstance(obj.get("text"), str):
            records.append(Record(where, text=obj["text"]))
        else:
            raise DataError(
                f"{where} has neither 'text', 'messages' nor 'conversations': "
                'write raw text as {"text": ...} or chats as {"messages": [...]}'
            )
    return records


def read_records(paths: Sequence[str | Path]) -> list[Record]:
    """Records of every path (files, folders, JSONL), in a stable order.

    Raises:
        DataError: a path does not exist, a JSONL line is malformed, or nothing was found.
    """
    records: list[Record] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(
                f"data path {path} does not exist: pass text files, folders or JSONL files"
            )
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if any(part.startswith(".") for part in f.relative_to(path.parent).parts):
                continue  # hidden files and folders (.git, .cache)
            if f.suffix == ".jsonl":
                records.extend(_read_jsonl(f))
                continue
            data = f.read_bytes()
            if _is_binary(data):
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                records.append(Record(str(f), text=text))
    records = [r for r in records if (r.text and r.text.strip()) or r.messages]
    if not records:
        shown = ", ".join(str(p) for p in paths) or "(none)"
        raise DataError(
            f"no training text found in {shown}: pass UTF-8 text files, folders of them, or JSONL "
            "records with 'text' or 'messages'"
        )
    return records


# ---- tokenizing ---------------------------------------------------------------------------------
def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _eos(tokenizer: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if eos is not None else None


def _render(tokenizer: Any, messages: list[dict[str, str]], gen: bool, kwargs: dict) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the data has chat records but the target's tokenizer has no chat template: "
            'use raw-text records ({"text": ...}) or a target with a chat template'
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen, **kwargs
    )
    return _encode(tokenizer, text)


def chat_sequence(
    tokenizer: Any, messages: list[dict[str, str]], chat_kwargs: dict[str, Any]
) -> TokenSeq | None:
    """Tokens of a rendered conversation, response mask on the assistant turns (None: no turn).

    Each assistant turn's span is found by rendering the conversation before it with the
    generation prompt (a prefix of the whole rendering for well-formed templates); turns whose
    prefix does not line up are left out of the loss.
    """
    full = _render(tokenizer, messages, False, chat_kwargs)
    mask = np.zeros(len(full), dtype=bool)
    first = None
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True, chat_kwargs) if i else []
        end = _render(tokenizer, messages[: i + 1], False, chat_kwargs)
        if full[: len(start)] != start or full[: len(end)] != end or len(end) <= len(start):
            continue
        mask[len(start) : len(end)] = True
        first = len(start) if first is None else first
    if first is None:
        return None
    return TokenSeq(np.asarray(full, dtype=np.int32), mask, first, True)


def tokenize(
    records: Sequence[Record],
    tokenizer: Any,
    seq_len: int,
    *,
    chat_kwargs: dict[str, Any] | None = None,
) -> list[TokenSeq]:
    """Sequences of at most ``seq_len`` tokens.

    Raw text is followed by the EOS token and cut into consecutive chunks of ``seq_len``; a chat
    is one sequence, truncated to ``seq_len``.
    """
    chat_kwargs = chat_kwargs or {}
    eos = _eos(tokenizer)
    # Whole documents are encoded, then cut: silence the "longer than model_max_length" warning.
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(inner, "model_max_length"):
        inner.model_max_length = 1 << 62
    out: list[TokenSeq] = []
    chats = unusable = 0
    for r in records:
        if r.messages is not None:
            chats += 1
            s = chat_sequence(tokenizer, r.messages, chat_kwargs)
            if s is None:
                unusable += 1
            else:
                out.append(TokenSeq(s.tokens[:seq_len], s.loss_mask[:seq_len], s.prompt_len, True))
            continue
        ids = _encode(tokenizer, r.text or "")
        if eos is not None:
            ids.append(eos)
        arr = np.asarray(ids, dtype=np.int32)
        for start in range(0, arr.size, seq_len):
            chunk = arr[start : start + seq_len]
            out.append(TokenSeq(chunk, np.ones(chunk.size, dtype=bool), 0, False))
    if chats and unusable == chats and not out:
        raise DataError(
            f"none of the {chats} chat records has an assistant turn that the chat template "
            "renders as a continuation of the conversation before it: add assistant turns, or "
            "pass the text as raw-text records"
        )
    return out


def usable(seqs: Sequence[TokenSeq], block_size: int) -> list[TokenSeq]:
    """Sequences with at least one valid anchor (a full block after one context token).

    Raises:
        DataError: none is left (every sequence is shorter than a block).
    """
    keep = [s for s in seqs if len(s) >= block_size + 1 and s.loss_mask[1:].any()]
    if not keep:
        longest = max((len(s) for s in seqs), default=0)
        raise DataError(
            f"no training sequence is long enough for a block of {block_size} tokens (longest: "
            f"{longest} tokens, a block needs {block_size + 1}): pass longer texts or a smaller "
            "--block-size"
        )
    return keep


def split_eval(
    seqs: list[TokenSeq], n: int, prompt_tokens: int, seed: int
) -> tuple[list[TokenSeq], list[list[int]]]:
    """Hold out ``n`` sequences as evaluation prompts; return (training sequences, prompts)."""
    if n <= 0:
        return seqs, []
    rng = np.random.default_rng(seed + 7919)
    order = rng.permutation(len(seqs))
    held: set[int] = set()
    prompts: list[list[int]] = []
    for i in order:
        if len(prompts) >= n or len(seqs) - len(held) <= 1:
            break
        p = prompt_of(seqs[i], prompt_tokens)
        if p:
            held.add(int(i))
            prompts.append(p)
    return [s for i, s in enumerate(seqs) if i not in held], prompts


def prompt_of(seq: TokenSeq, prompt_tokens: int) -> list[int] | None:
    """Evaluation prompt of a sequence: the chat before its first answer, or the first tokens."""
    if seq.chat:
        return seq.tokens[: seq.prompt_len].tolist() if seq.prompt_len > 0 else None
    if len(seq) <= prompt_tokens:
        return None
    return seq.tokens[:prompt_tokens].tolist()


def eval_prompts(seqs: Sequence[TokenSeq], n: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``n`` prompts of evaluation sequences (from ``--eval-data``), in order."""
    out: list[list[int]] = []
    if n <= 0:
        return out  # --eval-prompts 0: no evaluation
    for s in seqs:
        p = prompt_of(s, prompt_tokens)
        if p:
            out.append(p)
        if len(out) >= n:
            break
    return out


# ---- prepared data sets (.npz) -------------------------------------------------------------------
#: Arrays of a prepared data set: what ``save_dataset`` writes and ``load_dataset`` needs.
DATASET_KEYS = ("tokens", "mask", "lengths", "prompt_lens", "chat", "eval_prompts")


def is_dataset(path: str | Path) -> bool:
    """Whether a ``--data`` path names a prepared data set (a ``.npz`` file)."""
    return Path(path).suffix == ".npz"


def save_dataset(path: Path, seqs: Sequence[TokenSeq], prompts: Sequence[Sequence[int]]) -> None:
    """Write tokenized (and regenerated) sequences and eval prompts as one ``.npz`` file.

    A run writes its own as ``OUT/checkpoint/dataset.npz``; passing that file as ``--data`` to
    another run reuses the data without tokenizing or regenerating it again.
    """
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    np.savez(
        path,
        tokens=np.concatenate([s.tokens for s in seqs]) if seqs else np.zeros(0, np.int32),
        mask=np.concatenate([s.loss_mask for s in seqs]) if seqs else np.zeros(0, bool),
        lengths=lengths,
        prompt_lens=np.array([s.prompt_len for s in seqs], dtype=np.int64),
        chat=np.array([s.chat for s in seqs], dtype=bool),
        eval_prompts=np.array(json.dumps([list(map(int, p)) for p in prompts])),
    )


_DATASET_FIX = "pass a dataset.npz that hf2q train-draft wrote (OUT/checkpoint/dataset.npz)"


def require_dataset(path: str | Path) -> Path:
    """``path`` as a Path; raises :class:`DataError` naming the fix when no such file exists."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data set {path} does not exist: {_DATASET_FIX}")
    return path


def load_dataset(
    path: str | Path, *, vocab_size: int | None = None, seq_len: int | None = None
) -> tuple[list[TokenSeq], list[list[int]]]:
    """Sequences and eval prompts of a data set written by :func:`save_dataset`.

    Raises:
        DataError: the file is not such a data set, holds token ids outside ``vocab_size`` (made
            with another tokenizer) or sequences longer than ``seq_len``.
    """
    path = require_dataset(path)
    fix = _DATASET_FIX
    try:
        # Read each array once: indexing an NpzFile decompresses the whole member every time.
        with np.load(path) as z:
            missing = [k for k in DATASET_KEYS if k not in z.files]
            if missing:
                raise DataError(f"{path} lacks {', '.join(missing)}: {fix}")
            tokens, mask = z["tokens"], z["mask"]
            lengths, prompt_lens, chat = z["lengths"], z["prompt_lens"], z["chat"]
            prompts = json.loads(str(z["eval_prompts"]))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path} as a data set ({exc}): {fix}") from exc
    if int(lengths.sum()) != tokens.size or mask.size != tokens.size:
        raise DataError(f"{path} is inconsistent (lengths do not add up): {fix}")
    if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
        raise DataError(
            f"{path} holds token id {int(tokens.max())}, beyond the target's {vocab_size} "
            "embeddings: it was made for another target; prepare it again with this --target"
        )
    if seq_len is not None and lengths.size and int(lengths.max()) > seq_len:
        raise DataError(
            f"{path} holds sequences of {int(lengths.max())} tokens, longer than --seq-len "
            f"{seq_len}: pass --seq-len {int(lengths.max())} or more"
        )
    seqs, start = [], 0
    for n, p, c in zip(lengths, prompt_lens, chat):
        n = int(n)
        seqs.append(TokenSeq(tokens[start : start + n], mask[start : start + n], int(p), bool(c)))
        start += n
    return seqs, prompts


# ---- regeneration -------------------------------------------------------------------------------
def regenerate(
    target: Any,
    seqs: Sequence[TokenSeq],
    *,
    seq_len: int,
    prompt_tokens: int,
    eos_ids: Sequence[int],
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
) -> Generator[tuple[int, int], None, list[TokenSeq]]:
    """Replace responses by the target's own continuation (plain decoding, mlx-lm caches).

    A generator: yields ``(done, total)`` prompts after each batch and returns the new sequences
    (``seqs = yield from regenerate(...)``).

    Raw text keeps the first ``prompt_tokens`` tokens of each sequence and generates up to
    ``seq_len - prompt_tokens`` more; a chat keeps the tokens before its first answer and
    generates the answer. Generation stops after an EOS token (kept). Only generated tokens
    are responses.
    """
    import mlx.core as mx

    jobs: list[list[int]] = []
    for s in seqs:
        if s.chat:
            p = s.tokens[: s.prompt_len].tolist()
        elif len(s) > prompt_tokens:  # a raw-text tail shorter than the prompt is left out
            p = s.tokens[:prompt_tokens].tolist()
        else:
            continue
        if 0 < len(p) < seq_len:
            jobs.append(p)
    # Equal-length prompts batch without padding (raw text: all of them).
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(jobs):
        by_len.setdefault(len(p), []).append(i)
    results: list[list[int] | None] = [None] * len(jobs)
    key = mx.random.key(seed)
    eos = set(int(e) for e in eos_ids)
    done = 0
    for plen, idxs in sorted(by_len.items()):
        for b0 in range(0, len(idxs), batch_size):
            chunk = idxs[b0 : b0 + batch_size]
            prompts = mx.array([jobs[i] for i in chunk], dtype=mx.int32)
            key, sub = mx.random.split(key)
            gen = _generate_batch(target, prompts, seq_len - plen, eos, temperature, sub)
            for i, g in zip(chunk, gen):
                results[i] = g
            done += len(chunk)
            yield done, len(jobs)
    out = []
    for p, g in zip(jobs, results):
        if not g:
            continue
        toks = np.asarray(p + g, dtype=np.int32)
        mask = np.zeros(toks.size, dtype=bool)
        mask[len(p) :] = True
        out.append(TokenSeq(toks, mask, len(p), False))
    return out


def _generate_batch(
    target: Any,
    prompts: Any,
    max_new: int,
    eos: set[int],
    temperature: float,
    key: Any,
) -> list[list[int]]:
    """Plain decoding of equal-length prompts (n, P); each row cut after its first EOS."""
    import mlx.core as mx

    model = target.model
    cache = target.make_cache()

    def pick(logits: Any, k: Any) -> Any:
        if temperature <= 0:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.random.categorical(logits.astype(mx.float32) / temperature, key=k).astype(
            mx.int32
        )

    logits = model(prompts, cache=cache)[:, -1]
    keys = mx.random.split(key, max_new)
    tok = pick(logits, keys[0])
    out = [tok]
    finished = np.zeros(prompts.shape[0], dtype=bool)
    for i in range(1, max_new):
        mx.eval(tok)
        finished |= np.isin(np.array(tok), list(eos)) if eos else False
        if finished.all():
            break
        logits = model(tok[:, None], cache=cache)[:, -1]
        tok = pick(logits, keys[i])
        out.append(tok)
    mx.eval(out)
    rows = np.stack([np.array(t) for t in out], axis=1).tolist()
    result = []
    for row in rows:
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        result.append([int(t) for t in row[:cut]])
    return result


# ---- batching -----------------------------------------------------------------------------------
@dataclass
class Batch:
    """Right-padded sequences: tokens (N, T) int32, loss_mask (N, T) bool, lengths (N,)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray


def make_batch(seqs: Sequence[TokenSeq], seq_len: int, pad_id: int) -> Batch:
    N = len(seqs)
    tokens = np.full((N, seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((N, seq_len), dtype=bool)
    lengths = np.zeros(N, dtype=np.int64)
    for i, s in enumerate(seqs):
        n = min(len(s), seq_len)
        tokens[i, :n] = s.tokens[:n]
        mask[i, :n] = s.loss_mask[:n]
        lengths[i] = n
    return Batch(tokens, mask, lengths)


def batch_order(n_seqs: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the sequences of batch ``step`` (0-based): epochs of a seeded permutation.

    A pure function of its arguments, so a resumed run sees exactly the batches it would have.
    """
    per_epoch = max(1, n_seqs // batch_size) if n_seqs >= batch_size else 1
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_seqs)
    if n_seqs < batch_size:
        return perm.tolist()
    return perm[k * batch_size : (k + 1) * batch_size].tolist()


def steps_per_epoch(n_seqs: int, batch_size: int) -> int:
    return max(1, n_seqs // batch_size)


def iterate_batches(
    seqs: Sequence[TokenSeq], batch_size: int, seq_len: int, pad_id: int, seed: int, start: int
) -> Iterator[tuple[int, list[int], Batch]]:
    """``(step, sequence indices, batch)`` from ``start`` on, forever."""
    step = start
    while True:
        idx = batch_order(len(seqs), batch_size, seed, step)
        yield step, idx, make_batch([seqs[i] for i in idx], seq_len, pad_id)
        step += 1
