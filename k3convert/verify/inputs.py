"""Inputs for ``verify``: seeded random ids, or real text / ids from a data file.

Random ids make any two runs comparable; real text makes perplexity meaningful. Every
problem with a data file is a ConfigError naming the file and line (or row), since a
silently dropped or clipped id would make the parity numbers lie.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.safetensors_io import strict_json_loads
from ..errors import ConfigError, short_repr
from ..runtime.forward_cmd import load_ids_file, load_tokenizer
from .metrics import IGNORE_INDEX

# A .txt file is read up to this many characters per wanted token (no token is longer),
# so a huge corpus is not tokenized whole for a handful of rows.
CHARS_PER_TOKEN_CAP = 32
#: the longest line of a .jsonl data file (a row is cut to seq_len tokens anyway)
MAX_LINE_CHARS = 64 << 20


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {short_repr(value)}.")
    return value


def random_ids(
    vocab: int, batch: int, seq_len: int, seed: int, *, avoid: Iterable[int] = frozenset()
) -> torch.Tensor:
    """[batch, seq_len] int64 ids uniform in [0, vocab), none of them in ``avoid``.

    Deterministic for the same arguments (a seeded torch.Generator, on the CPU). Ids
    drawn from ``avoid`` (image / special tokens) are redrawn once, uniformly from the
    allowed ids, so the other ids are those of the same seed without ``avoid``.
    """
    _positive("vocab", vocab)
    _positive("batch", batch)
    _positive("seq_len", seq_len)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {short_repr(seed)}.")
    avoid = list(avoid)
    bad_avoid = next((a for a in avoid if isinstance(a, bool) or not isinstance(a, int)), None)
    if bad_avoid is not None:
        raise ConfigError(f"ids to avoid must be integers, got {short_repr(bad_avoid)}.")
    g = torch.Generator().manual_seed(seed % 2**64)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g, dtype=torch.int64)
    avoid_t = torch.tensor(sorted({a for a in avoid if 0 <= a < vocab}), dtype=torch.int64)
    if avoid_t.numel() == 0:
        return ids
    allowed = torch.arange(vocab, dtype=torch.int64)
    allowed = allowed[~torch.isin(allowed, avoid_t)]
    if allowed.numel() == 0:
        raise ConfigError(f"every id in [0, {vocab}) is to be avoided; no random ids possible.")
    hit = torch.isin(ids, avoid_t)
    n = int(hit.sum())
    if n:
        ids[hit] = allowed[torch.randint(0, allowed.numel(), (n,), generator=g)]
    return ids


def load_data(
    path: str | os.PathLike,
    *,
    seq_len: int,
    vocab: int,
    tokenizer_dir: str | os.PathLike | None = None,
    max_samples: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(input_ids [B, S] int64, attention_mask [B, S] int64, is_text) from a data file.

    - ``.jsonl``: one JSON object a line with ``input_ids`` (a list of ints) or ``text``
      (tokenized by the tokenizer in ``tokenizer_dir`` with its special tokens, e.g. BOS;
      never with custom code); blank lines are skipped, as are rows with no tokens.
    - ``.txt``: the whole text, tokenized, cut into rows of ``seq_len`` tokens.
    - ``.safetensors``: ``input_ids`` [B, S] or [S] and an optional ``attention_mask``;
      rows whose mask is all 0 are skipped, padded positions' ids are set to 0.

    Rows are cut to ``seq_len`` and right-padded (id 0, mask 0) to the longest row, so
    S = min(seq_len, longest row); at most ``max_samples`` rows. Every id must be an
    integer in [0, vocab). is_text is True: the ids are real text / real tokens, so
    perplexity means something (random_ids are the other kind).
    """
    seq_len = _positive("seq_len", seq_len)
    vocab = _positive("vocab", vocab)
    max_samples = _positive("max_samples", max_samples)
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        raise ConfigError(f"data file {p}: no such file.") from None
    if not stat.S_ISREG(mode):  # a FIFO would block the read
        raise ConfigError(f"data file {p}: not a regular file (a directory, FIFO or device).")
    suffix = p.suffix.lower()
    tok = _Tok(tokenizer_dir)
    if suffix == ".jsonl":
        rows = _jsonl_rows(p, seq_len, vocab, max_samples, tok)
    elif suffix == ".txt":
        rows = _txt_rows(p, seq_len, vocab, max_samples, tok)
    elif suffix == ".safetensors":
        return _safetensors_data(p, seq_len, vocab, max_samples)
    else:
        raise ConfigError(
            f"data file {p}: unsupported type {p.suffix or '(none)'!r}; give a .jsonl "
            f"(input_ids or text per line), .txt or .safetensors (input_ids) file."
        )
    if not rows:
        raise ConfigError(f"data file {p}: no usable rows (empty, or no tokens).")
    return (*_pad(rows), True)


class _Tok:
    """The checkpoint's tokenizer, loaded on first use (only text needs it)."""

    def __init__(self, tokenizer_dir: str | os.PathLike | None):
        self.dir = tokenizer_dir
        self.tok: Any = None

    def encode(self, text: str, where: str) -> list[int]:
        from ..checkpoint.tokenizer_files import is_panic, quiet_panics

        if self.tok is None:
            note = None
            if self.dir is not None:  # (files checked, a panic at load or on a probe
                self.tok, note = load_tokenizer(Path(self.dir))  # text: the note says why)
            if self.tok is None:
                why = note or (
                    f"no tokenizer in {self.dir}" if self.dir is not None else "no tokenizer given"
                )
                raise ConfigError(
                    f"data file {where} has text, but {why}; give token ids instead "
                    f'(a .jsonl with {{"input_ids": [...]}} per line, or a .safetensors file).'
                )
        try:
            with quiet_panics():
                return list(self.tok.encode(text))
        except BaseException as e:  # a Rust panic (a regex past its backtracking limit)
            if not is_panic(e):
                raise
            raise ConfigError(
                f"data file {where}: the tokenizer of {self.dir} crashed on this text "
                f"(tokenizers panic: {str(e).strip()[:200]}); its tokenizer.json is damaged "
                f"- fix it, or give token ids instead."
            ) from None


def _check_ids(ids: Any, vocab: int, where: str) -> list[int]:
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: input_ids must be a list of integers, got {short_repr(ids)}.")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ConfigError(f"{where}: token id {short_repr(t)} is not an integer.")
        if not 0 <= t < vocab:
            raise ConfigError(
                f"{where}: token id {str(t)[:30]} is not in [0, {vocab}) (vocab size {vocab})."
            )
    return ids


def _jsonl_rows(p: Path, seq_len: int, vocab: int, max_samples: int, tok: _Tok) -> list[list[int]]:
    rows: list[list[int]] = []
    try:
        with p.open(encoding="utf-8") as f:
            n = 0
            while len(rows) < max_samples and (line := f.readline(MAX_LINE_CHARS + 1)):
                n += 1
                where = f"{p} line {n}"
                if len(line) > MAX_LINE_CHARS:
                    raise ConfigError(
                        f"{where}: longer than {MAX_LINE_CHARS:,} characters; a row is cut to "
                        f"seq_len tokens anyway - shorten the line."
                    )
                if not line.strip():
                    continue
                try:  # nesting too deep for the parser is a JSONDecodeError too
                    obj = strict_json_loads(line, f"{where}: key", ConfigError)
                except ValueError as e:
                    raise ConfigError(f"{where}: not valid JSON ({e}).") from None
                if not isinstance(obj, dict) or ("input_ids" in obj) == ("text" in obj):
                    raise ConfigError(
                        f'{where}: expected an object with "input_ids" (a list of ints) or '
                        f'"text" (a string), exactly one of them; got {short_repr(obj)}.'
                    )
                if "input_ids" in obj:
                    ids = _check_ids(obj["input_ids"], vocab, where)
                else:
                    if not isinstance(obj["text"], str):
                        raise ConfigError(f'{where}: "text" must be a string.')
                    ids = _check_ids(tok.encode(obj["text"], where), vocab, f"{where} (tokenized)")
                if ids:
                    rows.append(ids[:seq_len])
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file {p}: not UTF-8 text ({e.reason}).") from None
    except OSError as e:
        raise ConfigError(f"data file {p}: cannot be read ({e.strerror or e}).") from None
    return rows


def _txt_rows(p: Path, seq_len: int, vocab: int, max_samples: int, tok: _Tok) -> list[list[int]]:
    cap = max(1 << 20, seq_len * max_samples * CHARS_PER_TOKEN_CAP)
    try:
        with p.open(encoding="utf-8") as f:
            text = f.read(cap)
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file {p}: not UTF-8 text ({e.reason}).") from None
    except OSError as e:
        raise ConfigError(f"data file {p}: cannot be read ({e.strerror or e}).") from None
    if not text.strip():
        raise ConfigError(f"data file {p}: empty; no usable rows.")
    ids = _check_ids(tok.encode(text, str(p)), vocab, f"{p} (tokenized)")
    ids = ids[: seq_len * max_samples]
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    s = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), s, dtype=torch.int64)
    mask = torch.zeros(len(rows), s, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[i, : len(r)] = 1
    return ids, mask


def _safetensors_data(
    p: Path, seq_len: int, vocab: int, max_samples: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    ids, mask = load_ids_file(p, "data file")
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.int64)
    elif mask.dtype.is_floating_point or bool(((mask != 0) & (mask != 1)).any()):
        raise ConfigError(f"data file {p}: attention_mask must hold only 0 and 1.")
    ids, mask = ids.to(torch.int64)[:, :seq_len], mask.to(torch.int64)[:, :seq_len]
    keep = mask.any(-1)
    ids, mask = ids[keep][:max_samples], mask[keep][:max_samples]
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ConfigError(f"data file {p}: no usable rows (empty, or every row all padding).")
    bad = (mask == 1) & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise ConfigError(
            f"data file {p}: input_ids[{r}, {c}] (row {r} of the usable rows) = "
            f"{int(ids[r, c])} is not in [0, {vocab}) (vocab size {vocab})."
        )
    ids = torch.where(mask == 1, ids, 0)
    # right-trim columns that are padding in every row, as for the text formats
    real = mask.any(0).nonzero()
    ids, mask = ids[:, : int(real[-1]) + 1], mask[:, : int(real[-1]) + 1]
    return ids.contiguous(), mask.contiguous(), True


def next_token_targets(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """targets [B, S]: ``input_ids[:, t + 1]`` where positions t and t + 1 are both real
    tokens, else -100 (ignored); the last position is always -100."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ConfigError("next_token_targets: input_ids must be a [B, S] tensor.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ConfigError(
            f"next_token_targets: attention_mask {tuple(attention_mask.shape)} does not "
            f"match input_ids {tuple(input_ids.shape)}."
        )
    real = attention_mask != 0
    out = torch.full_like(input_ids, IGNORE_INDEX, dtype=torch.int64)
    both = real[:, :-1] & real[:, 1:]
    out[:, :-1] = torch.where(both, input_ids[:, 1:].to(torch.int64), IGNORE_INDEX)
    return out
