# SPDX-License-Identifier: MIT
"""Real text that is present on a machine without network: the Python source files of installed
packages, split by top-level package so that one package can be held out for evaluation; and
the byte-level tokenizer that train_small.py's models use.

A model directory written by train_small.py holds `kvtier_tokenizer.json` ({"type": "bytes"}) and
`train_meta.json` (with the held-out package); a directory with a transformers tokenizer (Llama,
Qwen, ...) is tokenized with it instead.
"""

from __future__ import annotations

import json
import os
import site
import sys
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

TOKENIZER_FILE = "kvtier_tokenizer.json"
META_FILE = "train_meta.json"


def site_dirs() -> List[str]:
    dirs = []
    for d in list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path:
        if d and os.path.isdir(d) and ("site-packages" in d or "dist-packages" in d):
            d = os.path.realpath(d)
            if d not in dirs:
                dirs.append(d)
    return dirs


def packages() -> Dict[str, str]:
    """Top-level package name -> directory, over every site directory."""
    out: Dict[str, str] = {}
    for d in site_dirs():
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if os.path.isdir(p) and name.isidentifier() and name != "__pycache__" \
                    and name not in out:
                out[name] = p
    return out


def source_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def read_package(root: str, max_bytes: int) -> List[bytes]:
    """The .py files of one package as documents, up to max_bytes in all."""
    docs, total = [], 0
    for path in source_files(root):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if not data.strip() or b"\0" in data:
            continue
        docs.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return docs


def train_text(held_out: str, max_bytes: int) -> np.ndarray:
    """uint8 bytes of every package but `held_out`, documents separated by two newlines, at most
    max_bytes (packages taken in name order, each up to an equal share first)."""
    pk = packages()
    if held_out not in pk:
        raise SystemExit("held-out package %r is not installed here (have: %s)"
                         % (held_out, ", ".join(sorted(pk)[:40])))
    names = [n for n in sorted(pk) if n != held_out]
    share = max(1 << 20, max_bytes // max(1, len(names)))
    parts, total = [], 0
    for n in names:
        for doc in read_package(pk[n], min(share, max_bytes - total)):
            parts.append(doc)
            parts.append(b"\n\n")
            total += len(doc) + 2
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def eval_docs(held_out: str, min_bytes: int, n_docs: int,
              max_bytes: int = 64 << 20) -> List[bytes]:
    """n_docs texts of at least min_bytes from the held-out package: files concatenated in path
    order until each is long enough (a long real context)."""
    pk = packages()
    if held_out not in pk:
        raise SystemExit("held-out package %r is not installed here" % held_out)
    docs, cur = [], b""
    for doc in read_package(pk[held_out], max_bytes):
        cur += doc + b"\n\n"
        if len(cur) >= min_bytes:
            docs.append(cur)
            cur = b""
            if len(docs) == n_docs:
                break
    if len(docs) < n_docs:
        raise SystemExit("package %r has too little text for %d documents of %d bytes"
                         % (held_out, n_docs, min_bytes))
    return docs


class Tokenizer:
    """Bytes (train_small.py's models) or the model directory's transformers tokenizer."""

    def __init__(self, model_dir: Optional[str]):
        self.kind, self.tok = "bytes", None
        if model_dir and os.path.exists(os.path.join(model_dir, TOKENIZER_FILE)):
            return
        if model_dir:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            self.kind = "transformers"

    def encode(self, data: bytes) -> List[int]:
        if self.tok is None:
            return list(data)
        return self.tok(data.decode("utf-8", "replace"), add_special_tokens=False).input_ids


def _byte_chars() -> List[str]:
    """The printable character that byte-level BPE tokenizers use for each byte value: printable
    Latin-1 bytes stand for themselves, the others are moved to 256 and up, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def save_bytes_tokenizer(model_dir: str) -> Optional[str]:
    """Mark the directory as byte-tokenized (what proof.py reads), and also save a transformers
    tokenizer that maps each byte to its own value as id (byte-level, no merges), so that tools
    which load AutoTokenizer (tools/capture_trace.py --prompt-file) tokenize text the same way.
    Returns why the transformers tokenizer could not be written, or None."""
    with open(os.path.join(model_dir, TOKENIZER_FILE), "w") as f:
        json.dump({"type": "bytes", "vocab_size": 256}, f)
    try:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {c: b for b, c in enumerate(_byte_chars())}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok)
        sample = "def f(x):\n\treturn 'é' + x  # ok\n"
        ids = fast(sample, add_special_tokens=False).input_ids
        if ids != list(sample.encode("utf-8")):
            return "the byte tokenizer does not give byte values (%s...)" % ids[:8]
        fast.save_pretrained(model_dir)
    except Exception as e:  # the marker above is enough for proof.py
        return "%s: %s" % (type(e).__name__, e)
    return None


def held_out_of(model_dir: Optional[str], default: str) -> str:
    if model_dir:
        p = os.path.join(model_dir, META_FILE)
        if os.path.exists(p):
            with open(p) as f:
                return json.load(f).get("eval_package", default)
    return default


def batches(data: np.ndarray, ctx: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, ctx + 1] random windows of data (int64)."""
    starts = rng.integers(0, len(data) - ctx - 1, size=batch)
    return np.stack([data[s:s + ctx + 1] for s in starts]).astype(np.int64)


def emit(figure: str, **fields: object) -> None:
    """One JSON line per figure on stdout."""
    print(json.dumps({"figure": figure, **fields}, sort_keys=False, default=str), flush=True)


__all__: Sequence[str] = ("packages", "train_text", "eval_docs", "Tokenizer", "emit",
                          "save_bytes_tokenizer", "held_out_of", "batches")
