"""Deterministic mutation fuzzing of the checkpoint reader and the stream reader.

Small valid inputs are built once per run, then each iteration copies one, mutates the
copy (byte flips, truncations, header length / offset / dtype / shape edits, duplicate,
swapped, renamed and deleted entries, index and manifest JSON edits, symlinks) and reads
all of it back:

  checkpoint  open_checkpoint(dir); meta / get_parts / get of every tensor
  stream      open_stream(dir); every unit of every rank; meta / get of every name;
              k3convert.stream.check.check(dir)
  native      every wrapper of k3convert.native with valid and hostile arguments (dtype,
              size, layout, device, index values, C int ranges); --native-lib runs a
              sanitizer build of the kernels (tests/test_fuzz.py: ASan + UBSan)

Every outcome must be a clean rejection (a k3convert.errors.K3Error) or an accepted
read whose bytes equal what the (possibly edited) header describes, read back here
independently from the file bytes; an accepted checkpoint must also have read nothing
outside its directory. Anything else is a failure, reported by site (exception type and
the innermost k3convert frame) with the mutation and the iteration that reproduces it.

Iteration ``i`` of seed ``s`` depends on nothing else, so ``--replay i`` reruns one.
tests/test_fuzz.py runs this module's :func:`run` with a fixed seed and iteration count.

Usage: python bench/fuzz.py [--seed 0] [--iterations N | --seconds S]
                            [--target checkpoint|stream|native|both] [--replay I]
                            [--verbose] [--native-lib PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/fuzz.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402
import zstandard  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import k3convert  # noqa: E402
from k3convert.errors import K3Error  # noqa: E402
from k3convert.stream import read_manifest_doc, write_manifest_doc  # noqa: E402

PKG = str(Path(k3convert.__file__).resolve().parent)

TARGETS = ("checkpoint", "stream")

#: the tiny llama of tests/test_cli_errors.py (head_dim 4, GQA 2:1)
LLAMA_CFG = {
    "model_type": "llama",
    "vocab_size": 16,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
LINEARS = {
    "self_attn.q_proj": (8, 8),
    "self_attn.k_proj": (4, 8),
    "self_attn.v_proj": (4, 8),
    "self_attn.o_proj": (8, 8),
    "mlp.gate_proj": (16, 8),
    "mlp.up_proj": (16, 8),
    "mlp.down_proj": (8, 16),
}
ST_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64,
}  # fmt: skip
ST_TORCH = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
    "F64": torch.float64,
}  # fmt: skip
PART_NAMES = (
    "weight", "weight_scale", "weight_scale_inv", "weight_packed", "weight_shape",
    "weight_zero_point", "weight_g_idx", "input_scale", "bias",
)  # fmt: skip
ODD_INTS = (0, 1, -1, 2, 3, 7, 8, 31, 32, 33, 2**31 - 1, 2**31, 2**32, 2**40, 2**53, 2**63 - 1,
            2**63, 2**64, -(2**63))  # fmt: skip


# -- outcomes -------------------------------------------------------------------------
class Mismatch(Exception):
    """An accepted read that disagrees with the file (or read outside the directory)."""


@dataclass
class Crash:
    count: int
    iteration: int
    mutation: str
    error: str
    trace: str


@dataclass
class Tally:
    target: str
    seed: int
    total: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    crashes: dict[str, Crash] = field(default_factory=dict)
    ops: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def n_crashes(self) -> int:
        return sum(c.count for c in self.crashes.values())

    def crash(self, i: int, mutation: str, e: BaseException) -> None:
        site = crash_site(e)
        if site in self.crashes:
            self.crashes[site].count += 1
        else:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            self.crashes[site] = Crash(1, i, mutation, f"{type(e).__name__}: {str(e)[:300]}", tb)

    def report(self, verbose: bool = False) -> str:
        rate = self.total / self.seconds if self.seconds else 0.0
        lines = [
            f"[{self.target}] seed {self.seed}: {self.total} iterations in {self.seconds:.1f} s "
            f"({rate:.0f}/s)",
            f"  accepted  {self.accepted}",
            f"  rejected  {sum(self.rejected.values())}",
        ]
        lines += [f"    {n:6d}  {k}" for k, n in self.rejected.most_common()]
        lines.append(f"  crashes   {self.n_crashes} at {len(self.crashes)} site(s)")
        for site, c in sorted(self.crashes.items(), key=lambda kv: -kv[1].count):
            lines.append(f"    {c.count:6d}  {site}")
            lines.append(f"            e.g. iteration {c.iteration}: {c.mutation}")
            lines.append(f"            {c.error}")
            lines.append(
                f"            replay: python bench/fuzz.py --target {self.target} "
                f"--seed {self.seed} --replay {c.iteration} --verbose"
            )
            if verbose:
                lines += ["            " + x for x in c.trace.rstrip().splitlines()]
        if self.notes:
            lines.append(
                "  notes     " + ", ".join(f"{k}: {n}" for k, n in sorted(self.notes.items()))
            )
        if verbose:
            lines.append(
                "  mutations " + ", ".join(f"{k}: {n}" for k, n in sorted(self.ops.items()))
            )
        return "\n".join(lines)


def crash_site(e: BaseException) -> str:
    """'Type at file:line in func' of the innermost frame inside k3convert (else the last)."""
    if isinstance(e, Mismatch):
        return f"Mismatch: {str(e).split(':', 1)[0]}"
    frames = traceback.extract_tb(e.__traceback__)
    pkg = [f for f in frames if str(Path(f.filename).resolve()).startswith(PKG)]
    f = (pkg or frames or [None])[-1]
    if f is None:
        return type(e).__name__
    if pkg:
        where = "k3convert/" + str(Path(f.filename).resolve())[len(PKG) + 1 :]
    else:
        where = Path(f.filename).name
    return f"{type(e).__name__} at {where}:{f.lineno} in {f.name}"


def classify(tally: Tally, i: int, mutation: str, fn: Callable[[], None]) -> str:
    """Run one read; count it as accepted, rejected (by K3Error class) or a crash."""
    tally.total += 1
    try:
        fn()
    except K3Error as e:
        tally.rejected[type(e).__name__] += 1
        return "rejected"
    except Exception as e:  # every other exception is what the fuzzer looks for
        tally.crash(i, mutation, e)
        return "crash"
    tally.accepted += 1
    return "accepted"


# -- safetensors bytes ----------------------------------------------------------------
def split_st(blob: bytes) -> tuple[dict, bytes] | None:
    """(header, data region) of a well-formed file; None if it does not parse."""
    if len(blob) < 8:
        return None
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        return None
    try:
        h = json.loads(blob[8 : 8 + n])
    except (ValueError, RecursionError):
        return None
    return (h, blob[8 + n :]) if isinstance(h, dict) else None


def join_st(header: dict | str, data: bytes, align: int = 8) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw + data


def nbytes(st: object, shape: object) -> int | None:
    """Byte size an entry describes, None if its dtype / shape are not valid."""
    if not isinstance(st, str) or st not in ST_BITS or not isinstance(shape, list):
        return None
    if not all(type(d) is int and 0 <= d < 2**20 for d in shape):
        return None
    return -(-math.prod(shape) * ST_BITS[st] // 8)


def entries(h: dict) -> list[str]:
    """Tensor names of a header in data order (unparseable offsets last)."""

    def key(k):
        o = h[k].get("data_offsets") if isinstance(h[k], dict) else None
        ok = isinstance(o, list) and o and type(o[0]) is int
        return (0, o[0]) if ok else (1, 0)

    return sorted((k for k in h if k != "__metadata__"), key=key)


def _old_bytes(src: object, data: bytes, n: int, rng: random.Random) -> bytes:
    """``n`` bytes for a re-laid-out tensor: its old bytes (if its old entry still says
    where they are), cut or extended with random bytes."""
    o = src.get("data_offsets") if isinstance(src, dict) else None
    buf = b""
    if isinstance(o, list) and len(o) == 2 and all(type(x) is int and x >= 0 for x in o):
        buf = data[o[0] : o[1]][:n]
    return buf + rng.randbytes(n - len(buf))


def relayout(h: dict, old: dict, data: bytes, rng: random.Random) -> bytes | None:
    """Contiguous offsets for the (edited) entries of ``h`` and a data region to match;
    each tensor keeps its old bytes where it can (cut or extended with random bytes)."""
    pos, out = 0, []
    for k in entries(h):
        e = h[k]
        if not isinstance(e, dict):
            return None
        n = nbytes(e.get("dtype"), e.get("shape"))
        if n is None or pos + n > 1 << 20:
            return None
        buf = _old_bytes(old.get(k), data, n, rng)
        e["data_offsets"] = [pos, pos + n]
        out.append(buf)
        pos += n
    return b"".join(out)


def odd_value(rng: random.Random, old: object) -> object:
    """A plausible-but-wrong replacement of a JSON value, by the old value's type."""
    if isinstance(old, bool):
        return rng.choice([not old, 0, 1, None, "true"])
    if isinstance(old, int):
        return rng.choice(
            [old + 1, old - 1, old * 2, old // 2, -old, rng.choice(ODD_INTS), True, False,
             float(old), old + 0.5, str(old), None, [old]]
        )  # fmt: skip
    if isinstance(old, float):
        return rng.choice([int(old), -old, 1e308, str(old), None])
    if isinstance(old, str):
        return rng.choice(
            [old + "x", old[:-1], "", "../" + old, "/" + old, old.upper(), "F32", "BF16",
             "I64", "U8", "F8_E4M3", "plain", "pack-quantized", "fp8-block", "zstd", "none",
             "weight", "weight_scale", "weight_shape", 7, None, [old]]
        )  # fmt: skip
    if isinstance(old, list):
        choices = [[], old + old[-1:], old[::-1], [True] * len(old), [old], None, "x", {}]
        if old:
            choices += [old[:-1], old[1:], [odd_value(rng, old[0]), *old[1:]]]
            choices += [[*old[:-1], odd_value(rng, old[-1])]]
        return rng.choice(choices)
    if isinstance(old, dict):
        choices: list = [{}, None, [], "x"]
        if old:
            k = rng.choice(sorted(old))
            choices += [{kk: v for kk, v in old.items() if kk != k}]
            choices += [{**old, k: odd_value(rng, old[k])}]
        return rng.choice(choices)
    return rng.choice([0, "", [], {}, "x", True, -1])


def deep_json(rng: random.Random) -> str:
    n = rng.choice([5_000, 100_000])
    return rng.choice(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n, "[" * n])


def edit_header(
    h: dict, rng: random.Random, parts: tuple[str, ...] = PART_NAMES
) -> tuple[str | dict, str]:
    """One edit of a parsed header: (new header dict or JSON text, description)."""
    names = entries(h)
    if not names:
        return {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "add entry"
    k = rng.choice(names)
    e = h[k] if isinstance(h[k], dict) else {}
    op = rng.choice(
        ["dtype", "dtype", "shape", "shape", "shape", "offsets", "offsets", "field", "delete",
         "duplicate", "swap-names", "swap-fields", "rename-part", "add", "entry-type",
         "metadata", "whole"]
    )  # fmt: skip
    if op == "dtype":
        new = rng.choice([*ST_BITS, "F4", "f32", "", 7, None, True, ["F32"], {"a": 1}])
        h[k] = {**e, "dtype": new}
        return h, f"dtype of '{k}' {e.get('dtype')!r} -> {new!r}"
    if op == "shape":
        s = e.get("shape")
        s = s if isinstance(s, list) else []
        cands: list = [odd_value(rng, s), [*s, 1], [1, *s], s[::-1], []]
        if s:
            i = rng.randrange(len(s))
            d = s[i] if type(s[i]) is int else 1  # an earlier edit may have left a non-int
            for v in (d + 1, d - 1, 0, d * 2, True, 2**40, 2**64, -1, float(d)):
                cands.append([*s[:i], v, *s[i + 1 :]])
            cands.append([math.prod(s)] if all(type(d) is int for d in s) else [0])
        new = rng.choice(cands)
        h[k] = {**e, "shape": new}
        return h, f"shape of '{k}' {s} -> {new!r}"
    if op == "offsets":
        o = e.get("data_offsets")
        o = o if isinstance(o, list) and len(o) == 2 else [0, 0]
        o = [v if type(v) is int else 0 for v in o]  # an earlier edit may have left non-ints
        other = h[rng.choice(names)]
        oo = other.get("data_offsets") if isinstance(other, dict) else None
        d = rng.choice([1, 2, 4, 8, 64, 4096])
        cands = [
            [o[0] + d, o[1] + d], [o[0] - d, o[1] - d], [o[0], o[1] + d], [o[0], o[1] - d],
            [o[0] + d, o[1]], [o[1], o[0]], oo, odd_value(rng, o), [o[0], True], [0, 2**64],
        ]  # fmt: skip
        new = rng.choice(cands)
        h[k] = {**e, "data_offsets": new}
        return h, f"data_offsets of '{k}' {o} -> {new!r}"
    if op == "field":
        f = rng.choice(["dtype", "shape", "data_offsets"])
        if rng.random() < 0.5:
            h[k] = {kk: v for kk, v in e.items() if kk != f}
            return h, f"drop field {f} of '{k}'"
        h[k] = {**e, "extra": rng.choice([1, "x", None])}
        return h, f"extra field in '{k}'"
    if op == "delete":
        del h[k]
        return h, f"delete entry '{k}'"
    if op == "duplicate":
        text = json.dumps(h, separators=(",", ":"))
        other = h[rng.choice(names)] if rng.random() < 0.5 else e
        dup = json.dumps({k: other}, separators=(",", ":"))[1:-1]
        return text[:-1] + "," + dup + "}", f"duplicate entry '{k}'"
    if op == "swap-names" and len(names) > 1:
        k2 = rng.choice([n for n in names if n != k])
        h[k], h[k2] = h[k2], h[k]
        return h, f"swap entries '{k}' and '{k2}'"
    if op == "swap-fields" and len(names) > 1:
        k2 = rng.choice([n for n in names if n != k])
        f = rng.choice(["dtype", "shape", "data_offsets"])
        e2 = h[k2] if isinstance(h[k2], dict) else {}
        h[k] = {**e, f: e2.get(f)}
        h[k2] = {**e2, f: e.get(f)}
        return h, f"swap {f} of '{k}' and '{k2}'"
    if op == "rename-part":
        base = k.rsplit(".", 1)[0] if "." in k else k
        new = f"{base}.{rng.choice(parts)}" if rng.random() < 0.8 else base + "_x"
        if new in h:
            h[new], h[k] = h[k], h[new]
        else:
            h = {(new if kk == k else kk): v for kk, v in h.items()}
        return h, f"rename '{k}' -> '{new}'"
    if op == "add":
        base = k.rsplit(".", 1)[0]
        new = f"{base}.{rng.choice(parts)}"
        h[new] = dict(e)
        return h, f"copy entry '{k}' as '{new}'"
    if op == "entry-type":
        new = rng.choice([None, [], "x", 1, {}])
        h[k] = new
        return h, f"entry '{k}' -> {new!r}"
    if op == "metadata":
        new = rng.choice([{"format": 1}, [], "x", {"a": {"b": "c"}}, None, {"format": "pt"}])
        h["__metadata__"] = new
        return h, f"__metadata__ -> {new!r}"
    new = rng.choice([[], "x", 1, None, [h]])
    return json.dumps(new), f"whole header -> {type(new).__name__}"


def mutate_st_bytes(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A byte-level edit of a safetensors file: flips, truncation, length prefix."""
    if len(blob) < 9:
        extra = rng.choice([1, 8, 64])
        return blob + rng.randbytes(extra), f"append {extra} bytes to {len(blob)}"
    op = rng.choice(["flip", "flip", "truncate", "extend", "length"])
    parsed = split_st(blob)
    hdr_end = len(blob) - len(parsed[1]) if parsed else min(len(blob), 256)
    if op == "flip":
        b = bytearray(blob)
        n = rng.choice([1, 1, 2, 4, 16])
        where = []
        for _ in range(n):
            i = rng.randrange(hdr_end) if rng.random() < 0.7 else rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
            where.append(i)
        return bytes(b), f"flip {n} bit(s) at {where[:4]}"
    if op == "truncate":
        cut = rng.choice([0, 3, 8, 9, hdr_end - 1, hdr_end, hdr_end + 1, len(blob) - 1,
                          rng.randrange(len(blob))])  # fmt: skip
        cut = max(0, min(cut, len(blob) - 1))
        return blob[:cut], f"truncate to {cut} of {len(blob)} bytes"
    if op == "extend":
        extra = rng.choice([1, 7, 8, 4096])
        return blob + rng.randbytes(extra), f"append {extra} bytes"
    (n,) = struct.unpack("<Q", blob[:8])
    new = rng.choice([n + 1, n - 1, n + 8, n - 8, 0, 1, 2, len(blob), len(blob) - 8,
                      2**63, 2**64 - 1, 100 * 1024 * 1024 + 1])  # fmt: skip
    new = max(0, min(new, 2**64 - 1))
    return struct.pack("<Q", new) + blob[8:], f"header length {n} -> {new}"


def mutate_st(blob: bytes, rng: random.Random, *, consistent: float = 0.5) -> tuple[bytes, str]:
    """One mutation of a safetensors file (bytes or header), sometimes re-laid out so
    that the file stays well-formed and only its meaning changed."""
    parsed = split_st(blob)
    r = rng.random()
    if parsed is None or r < 0.3:
        return mutate_st_bytes(blob, rng)
    h, data = parsed
    if r < 0.33:
        return join_st(deep_json(rng), data), "deeply nested header"
    if r < 0.5:
        return data_edit(h, data, rng)
    old = json.loads(json.dumps(h))
    new, what = edit_header(h, rng)
    if isinstance(new, dict) and rng.random() < consistent:
        d2 = relayout(new, old, data, rng)
        if d2 is not None:
            return join_st(new, d2), what + " (re-laid out)"
    return join_st(new, data), what


def data_edit(h: dict, data: bytes, rng: random.Random, align: int = 8) -> tuple[bytes, str]:
    """Overwrite the values of one tensor (integers with odd values, floats with NaN/inf),
    keeping the header: e.g. a weight_shape of [2**40, -1]."""

    def ok(k):
        e = h[k]
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str):
            return False
        if e["dtype"] not in ST_BITS:
            return False
        o = e.get("data_offsets")
        return (
            isinstance(o, list)
            and len(o) == 2
            and all(type(x) is int for x in o)
            and 0 <= o[0] < o[1] <= len(data)
        )

    names = [k for k in entries(h) if ok(k)]
    if not names:
        return mutate_st_bytes(join_st(h, data, align), rng)
    ints = [k for k in names if h[k]["dtype"] in ("I64", "I32")]
    k = rng.choice(ints if ints and rng.random() < 0.7 else names)
    e = h[k]
    b0, b1 = e["data_offsets"]
    d = bytearray(data)
    st = e["dtype"]
    w = ST_BITS[st] // 8
    if st in ("I64", "I32") and (b1 - b0) % w == 0:
        fmt = "<q" if st == "I64" else "<i"
        lim = 2 ** (8 * w - 1)
        vals = []
        for j in range(b0, b1, w):
            v = rng.choice([*ODD_INTS, struct.unpack(fmt, d[j : j + w])[0]])
            v = max(-lim, min(lim - 1, v))
            d[j : j + w] = struct.pack(fmt, v)
            vals.append(v)
        return join_st(h, bytes(d), align), f"values of '{k}' -> {vals[:4]}"
    specials = {
        "F32": [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x00\x00"],
        "BF16": [b"\xc0\x7f", b"\x80\x7f", b"\x00\x00"],
        "F16": [b"\x00\x7e", b"\x00\x7c", b"\x00\x00"],
    }
    if st in specials and (b1 - b0) >= w:
        j = b0 + rng.randrange((b1 - b0) // w) * w
        d[j : j + w] = rng.choice(specials[st])
        return join_st(h, bytes(d), align), f"a NaN/inf/0 into '{k}'"
    d[rng.randrange(b0, b1)] ^= 0xFF
    return join_st(h, bytes(d), align), f"data byte of '{k}'"


class Pristine:
    """A template directory held in memory, to put a mutated copy back cheaply (rewrite
    what changed, drop what was added) instead of deleting and copying a tree."""

    def __init__(self, template: Path):
        self.template = template
        self.files = {
            p.relative_to(template): p.read_bytes()
            for p in sorted(template.rglob("*"))
            if p.is_file()
        }
        self.dirs = {p.relative_to(template) for p in template.rglob("*") if p.is_dir()}

    def restore(self, d: Path) -> Path:
        if not d.exists():
            shutil.copytree(self.template, d)
            return d
        for p in sorted(d.rglob("*"), reverse=True):  # children before their folders
            rel = p.relative_to(d)
            if p.is_symlink() or (not p.is_dir() and rel not in self.files):
                p.unlink()
            elif p.is_dir() and rel not in self.dirs:
                shutil.rmtree(p)
        for rel in sorted(self.dirs):
            (d / rel).mkdir(exist_ok=True)
        for rel, data in self.files.items():
            q = d / rel
            with contextlib.suppress(OSError):
                if q.stat().st_size == len(data) and q.read_bytes() == data:
                    continue
            q.write_bytes(data)
        return d


# -- checkpoint target ----------------------------------------------------------------
def _llama_state(g: torch.Generator) -> dict[str, torch.Tensor]:
    c = LLAMA_CFG
    sd = {
        "model.embed_tokens.weight": torch.randn(c["vocab_size"], 8, generator=g),
        "model.norm.weight": torch.rand(8, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(c["vocab_size"], 8, generator=g).to(torch.float16),
    }
    L = "model.layers.0."
    for n, s in LINEARS.items():
        sd[f"{L}{n}.weight"] = torch.randn(*s, generator=g)
    sd[L + "input_layernorm.weight"] = torch.rand(8, generator=g)
    sd[L + "post_attention_layernorm.weight"] = torch.rand(8, generator=g)
    return sd


def _packed(sd: dict, names: list[str], symmetric: bool, group: int = 8) -> dict:
    from k3convert.formats.intn import pack_int32
    from tests.encode import int_group_quantize

    out = {}
    for n, w in sd.items():
        if n not in names:
            out[n] = w
            continue
        q = int_group_quantize(w, 4, group, symmetric)
        base = n.removesuffix("weight")
        out[base + "weight_packed"] = pack_int32(q["q"], 4)
        out[base + "weight_scale"] = q["scale"]
        out[base + "weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        if not symmetric:
            out[base + "weight_zero_point"] = pack_int32(q["zero_point"], 4, packed_dim=0)
    return out


def _write_dir(d: Path, cfg: dict, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / name)
    return d


def build_checkpoints(root: Path) -> list[Path]:
    """Small valid checkpoint directories: plain (f32/bf16/f16), int4 pack-quantized
    (symmetric and with zero points), FP8 128x128-style blocks (4x4 here, one e8m0
    scale), and a two-file index layout."""
    from tests.encode import fp8_block_quantize, pack_quantized_config

    g = torch.Generator().manual_seed(1234)
    sd = _llama_state(g)
    lin = [f"model.layers.0.{n}.weight" for n in LINEARS]
    dirs = [_write_dir(root / "plain", LLAMA_CFG, {"model.safetensors": sd})]
    for sym in (True, False):
        qc = pack_quantized_config(4, 8, sym, ["lm_head"])
        cfg = {**LLAMA_CFG, "quantization_config": qc}
        name = "int4-sym" if sym else "int4-asym"
        dirs.append(_write_dir(root / name, cfg, {"model.safetensors": _packed(sd, lin, sym)}))
    fp8 = {}
    for n, w in sd.items():
        if n in lin:
            fmt = "e8m0" if "down_proj" in n else "float32"
            q, s = fp8_block_quantize(w, (4, 4), fmt)
            fp8[n], fp8[n.removesuffix("weight") + "weight_scale_inv"] = q, s
        else:
            fp8[n] = w
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]}
    dirs.append(_write_dir(root / "fp8", {**LLAMA_CFG, "quantization_config": qc},
                           {"model.safetensors": fp8}))  # fmt: skip
    names = list(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    d = _write_dir(root / "sharded", LLAMA_CFG,
                   {f: {n: sd[n] for n in ns} for f, ns in halves.items()})  # fmt: skip
    wm = {n: f for f, ns in halves.items() for n in ns}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    dirs.append(d)
    return dirs


def mutate_checkpoint(d: Path, outside: Path, rng: random.Random) -> str:
    """Mutate the copied checkpoint ``d`` in place; ``outside`` is a pristine copy outside
    ``d`` (the target of links and index paths that leave ``d``)."""
    weights = sorted(d.glob("*.safetensors"))
    idx = d / "model.safetensors.index.json"
    r = rng.random()
    if r < 0.04:  # a weight file, the config or an aux file becomes a link out of d
        f = rng.choice([*weights, d / "config.json", d / "tokenizer.json"])
        f.unlink()
        f.symlink_to(outside / f.name)
        return f"{f.name} -> symlink to a copy outside the model directory"
    if r < 0.07:
        text = deep_json(rng)
        f = rng.choice([d / "config.json", idx] if idx.exists() else [d / "config.json"])
        f.write_text(text)
        return f"{f.name}: deeply nested JSON"
    if idx.exists() and r < 0.2:
        j = json.loads(idx.read_text())
        wm = j["weight_map"]
        k = rng.choice(sorted(wm))
        new = rng.choice(
            [os.path.relpath(outside / wm[k], d), str(outside / wm[k]), "missing.safetensors",
             rng.choice(sorted(set(wm.values()))), "", 3, None, str(d / wm[k]),
             f"./{wm[k]}", f"sub/../{wm[k]}"]
        )  # fmt: skip
        if rng.random() < 0.5 and isinstance(new, str):  # the whole file moves
            old = wm[k]
            for kk in wm:
                if wm[kk] == old:
                    wm[kk] = new
        elif rng.random() < 0.3:
            del wm[k]
            new = "(deleted)"
        else:
            wm[k] = new
        idx.write_text(json.dumps(j))
        return f"index: weight_map['{k}'] -> {new!r}"
    f = rng.choice(weights)
    blob, what = mutate_st(f.read_bytes(), rng)
    n_more = rng.choice([0, 0, 0, 1])
    for _ in range(n_more):
        blob, more = mutate_st(blob, rng)
        what += "; then " + more
    f.write_bytes(blob)
    return f"{f.name}: {what}"


def verify_checkpoint(d: Path) -> None:
    """Open and read everything; raise Mismatch if an accepted read is wrong."""
    from k3convert.checkpoint import open_checkpoint

    ck = open_checkpoint(d)
    real = d.resolve()
    for p in [*(fi.path for fi in ck.files()), *ck.aux_files]:
        if not p.resolve().is_relative_to(real):
            raise Mismatch(f"read outside the model directory: {p} -> {p.resolve()}")
    headers: dict[Path, tuple[dict, int, bytes]] = {}
    for name in ck.names():
        m = ck.meta(name)
        parts = ck.get_parts(name)
        if set(parts) != set(m.parts):
            raise Mismatch(f"parts differ from meta: '{name}' {sorted(parts)} vs {sorted(m.parts)}")
        for k, t in parts.items():
            pm = m.parts[k]
            if pm.file not in headers:
                blob = pm.file.read_bytes()
                parsed = split_st(blob)
                if parsed is None:
                    raise Mismatch(f"accepted a file plain json cannot parse: {pm.file.name}")
                headers[pm.file] = (parsed[0], len(blob) - len(parsed[1]), blob)
            h, base, blob = headers[pm.file]
            e = h.get(pm.name)
            if not isinstance(e, dict):
                raise Mismatch(f"tensor not in the header: '{pm.name}' in {pm.file.name}")
            if ST_TORCH.get(e["dtype"]) != t.dtype or list(t.shape) != e["shape"]:
                raise Mismatch(
                    f"dtype/shape differ from the header: '{pm.name}' read as "
                    f"{t.dtype}{list(t.shape)}, header {e['dtype']}{e['shape']}"
                )
            b0, b1 = e["data_offsets"]
            got = (
                t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            )
            if got != blob[base + b0 : base + b1]:
                raise Mismatch(f"bytes differ from the file: '{pm.name}' in {pm.file.name}")
        w = ck.get(name)
        if tuple(w.shape) != m.shape:
            raise Mismatch(f"get() shape differs from meta: '{name}' {tuple(w.shape)} vs {m.shape}")
        if m.encoding != "plain" and w.dtype != torch.float32:
            raise Mismatch(f"dequantized dtype is not float32: '{name}' {w.dtype}")
        if m.encoding != "plain":
            ck.get(name, dtype=torch.bfloat16)


class CheckpointFuzzer:
    target = "checkpoint"

    def __init__(self, work: Path):
        self.templates = [Pristine(t) for t in build_checkpoints(work / "templates")]
        self.case = work / "case"

    def iteration(self, i: int, rng: random.Random, tally: Tally) -> str:
        t = rng.choice(self.templates)
        d = t.restore(self.case / t.template.name)
        # the pristine template is the real, intact copy outside d that links point to
        what = f"[{t.template.name}] " + mutate_checkpoint(d, t.template, rng)
        tally.ops[t.template.name] += 1
        classify(tally, i, what, lambda: verify_checkpoint(d))
        return what


# -- stream target --------------------------------------------------------------------
def build_streams(root: Path) -> list[Path]:
    """tp2 streams of the tiny llama: plain (none, zstd) and int4 gate/up (none, zstd)."""
    from k3convert.shard import shard
    from tests.encode import pack_quantized_config

    g = torch.Generator().manual_seed(4321)
    sd = _llama_state(g)
    plain = _write_dir(root / "src-plain", LLAMA_CFG, {"model.safetensors": sd})
    lin = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    ignore = [f"model.layers.0.{n}" for n in LINEARS if "gate" not in n and "up_" not in n]
    qc = pack_quantized_config(4, 8, False, [*ignore, "lm_head"])
    packed = _write_dir(root / "src-int4", {**LLAMA_CFG, "quantization_config": qc},
                        {"model.safetensors": _packed(sd, lin, False)})  # fmt: skip
    outs = []
    for src in (plain, packed):
        for comp in ("none", "zstd"):
            out = root / f"{src.name.removeprefix('src-')}-{comp}"
            shard(src=src, out=out, tp=2, compress=comp, progress=False, workers=1)
            outs.append(out)
    return outs


def _fixup(doc: dict, root: Path, u: dict, raw: bytes) -> None:
    """Make the manifest's sizes and hashes of unit ``u`` match new raw unit bytes."""
    path = root / u["file"]
    stored = raw if u["compression"] == "none" else zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(stored)
    u["bytes"] = len(stored)
    u["hash"] = "xxh3-128:" + xxhash.xxh3_128(stored).hexdigest()
    u["raw_bytes"] = len(raw)
    u["raw_hash"] = "xxh3-128:" + xxhash.xxh3_128(raw).hexdigest()


def _unit_raw(root: Path, u: dict) -> bytes:
    data = (root / u["file"]).read_bytes()
    if u["compression"] == "zstd":
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 24)
    return data


def _json_paths(o, path=()) -> list[tuple]:
    out = [path]
    if isinstance(o, dict):
        for k in o:
            out += _json_paths(o[k], (*path, k))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            out += _json_paths(v, (*path, i))
    return out


def _set(doc, path: tuple, value) -> None:
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _get(doc, path: tuple):
    for k in path:
        doc = doc[k]
    return doc


UNIT_KEYS = ("file", "bytes", "hash", "raw_bytes", "raw_hash", "compression", "name",
             "index", "layer")  # fmt: skip
TENSOR_KEYS = ("dtype", "shape", "encoding", "part", "logical", "name", "quant", "split_dim",
               "logical_shape", "global_shape", "contents", "tied_to", "offset", "pad")  # fmt: skip


def mutate_manifest(doc: dict, root: Path, template: Path, rng: random.Random) -> str:
    """One JSON edit of the manifest: a targeted unit / tensor / file field, or any node."""
    r = rng.random()
    rank = rng.randrange(len(doc["ranks"]))
    units = doc["ranks"][rank]["units"]
    ui = rng.randrange(len(units))
    u = units[ui]
    if r < 0.3:
        k = rng.choice(UNIT_KEYS)
        old = u.get(k)
        new = odd_value(rng, old)
        if k == "file" and rng.random() < 0.5:
            new = rng.choice([str(template / u["file"]), "../" + u["file"],
                              units[rng.randrange(len(units))]["file"], u["file"] + ".zst",
                              u["file"].replace("rank00000", "rank00001")])  # fmt: skip
        u[k] = new
        return f"ranks[{rank}].units[{ui}].{k} {old!r} -> {new!r}"
    if r < 0.65 and u["tensors"]:
        ti = rng.randrange(len(u["tensors"]))
        e = u["tensors"][ti]
        k = rng.choice(TENSOR_KEYS)
        old = e.get(k)
        new = odd_value(rng, old)
        if rng.random() < 0.1:
            e.pop(k, None)
            new = "(deleted)"
        else:
            e[k] = new
        return f"ranks[{rank}].units[{ui}].tensors[{ti}] ('{e.get('name')}').{k} {old!r} -> {new!r}"
    if r < 0.72 and doc.get("files"):
        fi = rng.randrange(len(doc["files"]))
        f = doc["files"][fi]
        k = rng.choice(["name", "bytes", "sha256"])
        old = f[k]
        new = odd_value(rng, old)
        if k == "name" and rng.random() < 0.6:
            new = rng.choice([str(template / old), "../" + template.name + "/" + old,
                              "rank00000", "manifest.json"])  # fmt: skip
        f[k] = new
        return f"files[{fi}].{k} {old!r} -> {new!r}"
    if r < 0.8 and len(u["tensors"]) > 1:
        i, j = rng.sample(range(len(u["tensors"])), 2)
        ts = u["tensors"]
        if rng.random() < 0.5:
            ts[i], ts[j] = ts[j], ts[i]
            return f"ranks[{rank}].units[{ui}]: swap tensors {i} and {j}"
        ts.append(json.loads(json.dumps(ts[i])))
        return f"ranks[{rank}].units[{ui}]: duplicate tensor {i}"
    paths = [p for p in _json_paths(doc) if p]
    p = rng.choice(paths)
    old = _get(doc, p)
    new = odd_value(rng, old)
    _set(doc, p, new)
    return f"manifest{''.join(f'[{k!r}]' for k in p)} {_short(old)} -> {_short(new)}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


def _save_doc(root: Path, doc: dict) -> None:
    """Write a mutated document back as the writer lays it out (version 3: rank files
    with their sizes recorded, then manifest.json); a document the mutation made
    unsplittable is written as manifest.json alone, as given."""
    try:
        write_manifest_doc(root, doc, fsync=False)
    except (TypeError, KeyError, ValueError, AttributeError):
        (root / "manifest.json").write_text(json.dumps(doc))


#: the mark of a mutation that no reader may accept (a rank directory of another stream)
FOREIGN = "foreign rank directory"


def mutate_files(root: Path, template: Path, rng: random.Random) -> str:
    """Where the stream's files are and whose they are: a rank directory swapped in from
    another template (another conversion of a model of the same shape: never to be
    accepted), manifest.json as a link (outside the stream, or inside it), a manifest or
    rank file past the format's size bound (sparse) or padded with whitespace."""
    from k3convert.stream.format import MAX_MANIFEST_BYTES

    mp = root / "manifest.json"
    ranks = sorted(p.name for p in root.glob("rank*") if p.is_dir())
    op = rng.randrange(5)
    if op == 0:
        others = sorted(
            p for p in template.parent.iterdir()
            if p.is_dir() and p != template and not p.name.startswith("src-")
        )  # fmt: skip
        other, rank = rng.choice(others), rng.choice(ranks)
        shutil.rmtree(root / rank)
        shutil.copytree(other / rank, root / rank)
        return f"{FOREIGN}: {rank} from {other.name}"
    if op == 1:
        mp.unlink()
        if rng.random() < 0.5:
            mp.symlink_to(template / "manifest.json")
            return "manifest.json -> a link outside the stream"
        (root / "manifest.real").write_bytes((template / "manifest.json").read_bytes())
        mp.symlink_to("manifest.real")
        return "manifest.json -> a link inside the stream"
    if op == 2:
        with open(mp, "r+b") as fh:
            fh.truncate(MAX_MANIFEST_BYTES + rng.choice([1, 4096]))
        return "manifest.json past the size bound (sparse)"
    target = mp if op == 3 else root / rng.choice(ranks) / "units.json"
    n = rng.choice([1, 7, 4096])
    with open(target, "ab") as fh:
        fh.write(b" " * n)
    if target != mp and rng.random() < 0.5:  # the recorded size updated too, not the hash
        top = json.loads(mp.read_text())
        i = int(target.parent.name[4:])
        top["ranks"][i]["units_bytes"] = target.stat().st_size
        mp.write_text(json.dumps(top))
        return f"{target.relative_to(root)}: {n} bytes of whitespace (units_bytes updated)"
    return f"{target.relative_to(root)}: {n} bytes of whitespace"


def mutate_stream(root: Path, template: Path, rng: random.Random) -> str:
    mp = root / "manifest.json"
    doc = read_manifest_doc(root)
    r = rng.random()
    if r < 0.06:
        return mutate_files(root, template, rng)
    r = rng.random()
    if r < 0.08:  # manifest bytes: manifest.json or one rank file
        rank_files = sorted(root.glob("rank*/units.json"))
        target = mp if not rank_files or rng.random() < 0.5 else rng.choice(rank_files)
        name = str(target.relative_to(root))
        text = target.read_bytes()
        if rng.random() < 0.3:
            target.write_text(deep_json(rng))
            return f"{name}: deeply nested JSON"
        if rng.random() < 0.5:
            cut = rng.randrange(len(text))
            target.write_bytes(text[:cut])
            return f"{name}: truncate to {cut}"
        b = bytearray(text)
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(b))
        return f"{name}: flip a bit at {i}"
    if r < 0.1 and doc.get("version") >= 3:  # the split: units_file / _bytes / _hash
        top = json.loads(mp.read_text())
        rank = rng.randrange(len(top["ranks"]))
        k = rng.choice(["units_file", "units_bytes", "units_hash", "stream_id"])
        if k == "stream_id":
            old = top.get(k)
            top[k] = odd_value(rng, old) if rng.random() < 0.5 else "xxh3-128:" + "0" * 32
            mp.write_text(json.dumps(top))
            return f"stream_id {old!r} -> {top[k]!r}"
        old = top["ranks"][rank].get(k)
        new = odd_value(rng, old)
        if k == "units_file" and rng.random() < 0.6:
            new = rng.choice([str(template / old), "../" + old, "rank00000/units.json",
                              old.replace("rank", "rank0"), "manifest.json"])  # fmt: skip
        top["ranks"][rank][k] = new
        mp.write_text(json.dumps(top))
        return f"ranks[{rank}].{k} {old!r} -> {new!r}"
    if r < 0.4:
        what = mutate_manifest(doc, root, template, rng)
        _save_doc(root, doc)
        return what
    rank = rng.randrange(len(doc["ranks"]))
    units = doc["ranks"][rank]["units"]
    ui = rng.randrange(len(units))
    u = units[ui]
    where = f"ranks[{rank}].units[{ui}] {u['file']}"
    if r < 0.45:
        path = root / u["file"]
        if rng.random() < 0.5:
            path.unlink()
            return f"{where}: deleted"
        blob = path.read_bytes()
        blob = blob[: rng.randrange(len(blob))] if rng.random() < 0.5 else blob + b"\0"
        path.write_bytes(blob)
        return f"{where}: stored file resized to {len(blob)} (manifest not updated)"
    raw = _unit_raw(root, u)
    parsed = split_st(raw)
    if parsed is not None and rng.random() < 0.6:  # a header edit that keeps the layout rules
        h, data = parsed
        old = json.loads(json.dumps(h))
        new, what = edit_header(h, rng)
        if isinstance(new, dict) and rng.random() < 0.6:
            raw2 = _aligned_relayout(new, old, data, rng)
            if raw2 is not None:
                what += " (re-laid out, aligned)"
                if rng.random() < 0.6:
                    what += _sync_manifest_tensors(u, new)
                raw = raw2
            else:
                raw = join_st(new, data, align=4096)
        else:
            raw = join_st(new, data, align=4096)
    elif parsed is not None and rng.random() < 0.3:
        raw, what = data_edit(parsed[0], parsed[1], rng, align=4096)
    else:
        raw, what = mutate_st_bytes(raw, rng)
    fix = rng.random() < 0.7
    if fix:
        _fixup(doc, root, u, raw)
        what += " (manifest sizes/hashes updated)"
    else:
        (root / u["file"]).write_bytes(
            raw if u["compression"] == "none" else zstandard.ZstdCompressor().compress(raw)
        )
    _save_doc(root, doc)
    return f"{where}: {what}"


def _aligned_relayout(h: dict, old: dict, data: bytes, rng: random.Random) -> bytes | None:
    """The edited header re-built by the format's own layout (4096-aligned tensors,
    __pad__ fillers), each tensor keeping its old bytes where it can."""
    from k3convert.stream.format import build_header

    meta = h.get("__metadata__")
    items, bufs = [], {}
    for k in entries(h):
        if k.startswith("__pad__."):
            continue
        e = h[k]
        if not isinstance(e, dict):
            return None
        n = nbytes(e.get("dtype"), e.get("shape"))
        if n is None or n > 1 << 20:
            return None
        items.append((k, e["dtype"], e["shape"]))
        bufs[k] = _old_bytes(old.get(k), data, n, rng)
    if not isinstance(meta, dict):
        return None
    try:
        prefix, placed, _ = build_header(items, {str(a): str(b) for a, b in meta.items()})
    except (ValueError, KeyError):
        return None
    out = bytearray(prefix)
    for t in placed:
        out += bytes(t.nbytes) if t.name.startswith("__pad__.") else bufs[t.name]
    h.clear()
    h.update(split_st(bytes(out))[0])
    return bytes(out)


def _sync_manifest_tensors(u: dict, h: dict) -> str:
    """Let the manifest's tensor list agree with an edited header (dtype / shape)."""
    n = 0
    for e in u["tensors"]:
        he = h.get(e["name"])
        if isinstance(he, dict) and (he["dtype"], he["shape"]) != (e["dtype"], e["shape"]):
            e["dtype"], e["shape"] = he["dtype"], he["shape"]
            n += 1
    return f" (manifest tensors synced: {n})" if n else ""


def verify_stream(root: Path, rng: random.Random) -> None:
    from k3convert.stream import open_stream

    st = open_stream(root, verify_hashes=rng.random() < 0.7)
    real = root.resolve()
    for r in range(st.world):
        rk = st.rank(r)
        for unit in rk.units(prefetch=rng.choice([0, 0, 2])):
            if not unit.file.resolve().is_relative_to(real):
                raise Mismatch(f"read outside the stream directory: {unit.file}")
            u = next(x for x in rk.unit_entries if x["name"] == unit.name)
            raw = _unit_raw(root, u)
            parsed = split_st(raw)
            if parsed is None:
                raise Mismatch(f"accepted a unit plain json cannot parse: {unit.file}")
            h, data = parsed
            base = len(raw) - len(data)
            for e in unit.entries:
                t = unit.tensors[e["name"]]
                he = h[e["name"]]
                if ST_TORCH.get(he["dtype"]) != t.dtype or list(t.shape) != he["shape"]:
                    raise Mismatch(f"unit tensor dtype/shape differ from the header: '{e['name']}'")
                b0, b1 = he["data_offsets"]
                got = (
                    t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    if t.numel()
                    else b""
                )
                if got != raw[base + b0 : base + b1]:
                    raise Mismatch(f"unit tensor bytes differ from the file: '{e['name']}'")
        for name in rk.names(include_tied=True):
            rk.meta(name)
            rk.get(name)


class StreamFuzzer:
    target = "stream"

    def __init__(self, work: Path):
        self.templates = [Pristine(t) for t in build_streams(work / "templates")]
        self.work = work

    def iteration(self, i: int, rng: random.Random, tally: Tally) -> str:
        from k3convert.stream.check import check

        t = rng.choice(self.templates)
        d = t.restore(self.work / "case" / t.template.name)
        what = f"[{t.template.name}] " + mutate_stream(d, t.template, rng)
        tally.ops[t.template.name] += 1
        foreign = FOREIGN in what
        if foreign:
            tally.notes["foreign rank directory"] += 1

        def read() -> None:
            verify_stream(d, rng)
            if foreign:
                raise Mismatch("accepted a rank directory from another conversion")

        read = classify(tally, i, what, read)
        try:  # check() is part of the iteration: it must report, never crash
            rep = check(d, workers=rng.choice([1, 2]))
            if rep.ok:
                _check_files_inside(d)
        except K3Error as e:
            tally.notes[f"check raised {type(e).__name__}"] += 1
        except Exception as e:
            tally.crash(i, what + " [in check()]", e)
        else:
            tally.notes[f"check {rep.status}"] += 1
            if rep.ok and foreign:
                tally.crash(i, what + " [in check()]", Mismatch("check() passed it: intact"))
            if rep.ok and read == "rejected":
                tally.notes["check intact but read rejected"] += 1
            if not rep.ok and read == "accepted":
                tally.notes["check not intact but read accepted"] += 1
        return what


def _check_files_inside(root: Path) -> None:
    """An intact check() must not have hashed files outside the stream directory."""
    doc = read_manifest_doc(root)
    real = root.resolve()
    for r in json.loads((root / "manifest.json").read_text())["ranks"]:
        if "units_file" in r and not (root / r["units_file"]).resolve().is_relative_to(real):
            raise Mismatch(f"check() read outside the stream directory: {r['units_file']}")
    for f in doc["files"]:
        if not (root / f["name"]).resolve().is_relative_to(real):
            raise Mismatch(f"check() read outside the stream directory: {f['name']}")
    for r in doc["ranks"]:
        for u in r["units"]:
            if not (root / u["file"]).resolve().is_relative_to(real):
                raise Mismatch(f"check() read outside the stream directory: {u['file']}")


# -- native target: the C kernels' wrappers ---------------------------------------------
_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.bfloat16)
_ODD_ARGS = (0, -1, 1, 2, 7, 64, 2**31 - 1, 2**31, 2**63, -(2**31) - 1, 1.5, True, "8", None)


def _u8(g: torch.Generator, *shape, hi: int = 256) -> torch.Tensor:
    return torch.randint(0, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def native_call(g: torch.Generator, rng: random.Random) -> tuple[str, Callable, dict]:
    """One valid call of a native wrapper: (name, function, keyword arguments)."""
    from k3convert import native

    rows, k = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 4])
    fn = rng.choice(["gather", "max_codes", "fp4_decode", "mx_fp8_block", "gather_nib",
                     "mx_int4", "mx_int4_search"])  # fmt: skip
    if fn == "gather":
        per, groups, keys = rng.choice([1, 8, 16]), rows * k, rng.randint(1, 3)
        dt = rng.choice([torch.uint8, torch.int32, torch.int64])
        table = torch.randint(0, 100, (keys * 256,), generator=g).to(dt)
        key = torch.randint(0, keys, (groups,), generator=g, dtype=torch.int32)
        out = torch.empty(groups * per, dtype=dt)
        kw = dict(src=_u8(g, groups * per), key=key, table=table, out=out)
    elif fn == "max_codes":
        per = rng.choice([1, 8, 16])
        kw = dict(src=_u8(g, rows * k * per), per=per, out=torch.empty(rows * k, dtype=torch.uint8))
    elif fn == "fp4_decode":
        group, dtype = rng.choice([16, 32]), rng.choice([torch.bfloat16, torch.float32])
        cols = group // 2 * k
        values = torch.randn(256, 16, generator=g).to(dtype)
        table = rng.choice([None, native.decode_table(values, dtype)])
        kw = dict(packed=_u8(g, rows, cols), codes=_u8(g, rows, k), values=values, dtype=dtype,
                  group=group, table=table)  # fmt: skip
    elif fn == "mx_fp8_block":
        b0, sub = rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
        kw = dict(
            packed=_u8(g, rows * b0, 16 * sub * k),
            codes=_u8(g, rows * b0, sub * k),
            block=(b0, 32 * sub),
            table=_u8(g, 256, 2, 16),
            top=_u8(g, 256, hi=8),
        )
    else:
        cols = 16 * k * rng.choice([1, 2])
        kw = dict(packed=_u8(g, rows, cols), codes=_u8(g, rows, cols // 16, hi=256))
        if fn == "gather_nib":
            groups, maps = rows * k, rng.randint(1, 4)
            kw = dict(src=_u8(g, 16 * groups), key=torch.randint(0, maps, (groups,), generator=g,
                      dtype=torch.int32), nibmap=_u8(g, maps * 16, hi=16),
                      out=torch.empty(16 * groups, dtype=torch.uint8))  # fmt: skip
        elif fn == "mx_int4":
            d_lo = rng.randint(-8, 0)
            span = rng.randint(1, 12)
            kw.update(sub=rng.choice([s for s in (1, 2, 4) if (cols // 16) % s == 0]),
                      values=torch.rand(2048, generator=g), nibmap=_u8(g, 3 * span, 16, hi=16),
                      code_range=(rng.randint(0, 120), rng.randint(120, 255)),
                      d_range=(d_lo, d_lo + span - 1))  # fmt: skip
        elif fn == "mx_int4_search":
            depth, ncand = rng.randint(0, 3), rng.randint(1, 16)
            err = torch.randint(0, 1 << 26, (8, depth + 1, 256, 16), generator=g,
                                dtype=torch.int32)  # fmt: skip
            kw.update(sub=rng.choice([s for s in (1, 2, 4) if (cols // 16) % s == 0]),
                      depth=depth, err=err, nibs=_u8(g, 8, ncand, depth + 2, 16, hi=16),
                      rel=torch.rand(8, ncand, generator=g),
                      vals=torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32),
                      zero_scale=rng.choice([1e-38, 0.0, 1.0]), zero_byte=rng.randint(0, 255),
                      code_range=(rng.randint(1, 120), rng.randint(120, 254)))  # fmt: skip
            if rng.random() < 0.5:  # the loss the search measures while it rounds
                rows_ = 8 * ncand * (depth + 1)
                ltab = _u8(g, rows_ + 1, 2, 16)  # any bytes: the kernel masks what it indexes
                kw["loss_tables"] = (ltab, _u8(g, 16),
                                     torch.rand(8, ncand, depth + 1, 16, generator=g))  # fmt: skip
    if rng.random() < 0.5:
        kw["nthreads"] = rng.choice([None, 1, 2, 3, 0, -5, 2**63, 2**31])
    if fn not in ("gather",) and rng.random() < 0.3:
        kw["simd"] = rng.choice([True, False, 0, 1, 2, 99])
    return fn, getattr(native, fn), kw


def mutate_native(kw: dict, rng: random.Random) -> str:
    """One hostile edit of a valid call's arguments (or none: a valid call)."""
    if rng.random() < 0.15:
        return "valid"
    key = rng.choice(sorted(kw))
    old = kw[key]
    if isinstance(old, torch.Tensor):
        op = rng.choice(["dtype", "grow", "shrink", "strided", "meta", "scalar", "not a tensor",
                         "values"])  # fmt: skip
        if op == "dtype":
            kw[key] = old.to(rng.choice([d for d in _DTYPES if d != old.dtype]))
        elif op == "grow":
            kw[key] = torch.zeros(old.numel() + rng.choice([1, 15, 256]), dtype=old.dtype)
        elif op == "shrink":
            kw[key] = old.reshape(-1)[: rng.randrange(max(old.numel(), 1))].clone()
        elif op == "strided":
            kw[key] = torch.cat([old.reshape(-1), old.reshape(-1)])[::2] if old.numel() else old.t()
            if old.ndim == 2 and old.shape[0] > 1 and old.shape[1] > 1:
                kw[key] = old.t().contiguous().t()  # the same shape, column-major
        elif op == "meta":
            kw[key] = torch.empty(old.shape, dtype=old.dtype, device="meta")
        elif op == "scalar":
            kw[key] = torch.tensor(3, dtype=old.dtype)
        elif op == "not a tensor":
            kw[key] = rng.choice(
                [None, 3, [1, 2], old.numpy() if old.dtype != torch.bfloat16 else 0]
            )
        else:  # out-of-range index values in a tensor the C code indexes with
            kw[key] = old.clone()
            if old.numel() and not old.is_floating_point():
                hi = torch.iinfo(old.dtype).max
                kw[key].view(-1)[rng.randrange(old.numel())] = rng.choice([hi, -1 % (hi + 1)])
        return f"{key}: {op}"
    if isinstance(old, tuple):
        new = rng.choice([(rng.choice(_ODD_ARGS), old[1]), (old[0], rng.choice(_ODD_ARGS)),
                          (old[1], old[0]), old[:1], (0, 0, 0), None])  # fmt: skip
    else:
        new = rng.choice(_ODD_ARGS)
    kw[key] = new
    return f"{key}: {old!r} -> {new!r}"


def _decode_reference(kw: dict) -> torch.Tensor:
    p, c = kw["packed"], kw["codes"]
    v = kw["values"]
    nib = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1).long()
    code = c.long().repeat_interleave(kw["group"], dim=1)
    return v[code, nib]


class NativeFuzzer:
    """The wrappers of :mod:`k3convert.native` with valid and hostile arguments: a call
    returns (accepted; a valid FP4 decode must equal its reference) or raises ValueError
    (rejected); anything else is a crash. Under an ASan + UBSan build of the kernels
    (``--native-lib``, as tests/test_fuzz.py runs it) a memory error aborts the run."""

    target = "native"

    def __init__(self, work: Path):
        from k3convert import native

        if native.library() is None:
            raise RuntimeError(f"--target native needs the kernels: {native.status()}")

    def iteration(self, i: int, rng: random.Random, tally: Tally) -> str:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        name, fn, kw = native_call(g, rng)
        what = f"{name}: " + mutate_native(kw, rng)
        tally.ops[name] += 1
        tally.total += 1
        try:
            res = fn(**kw)
        except ValueError:
            tally.rejected[f"ValueError ({name})"] += 1
            return what
        except Exception as e:
            tally.crash(i, what, e)
            return what
        tally.accepted += 1
        if what.endswith("valid") and name == "fp4_decode":
            ref = _decode_reference(kw)
            if not torch.equal(res.view(torch.uint8), ref.contiguous().view(torch.uint8)):
                tally.crash(i, what, Mismatch("fp4_decode: bytes differ from the reference"))
        return what


def load_native_library(path: str) -> None:
    """Bind ``path`` (a build of fp4_kernels.c, e.g. with -fsanitize=address,undefined) in
    place of the package's extension module, for this process."""
    import ctypes

    from k3convert import native

    lib = ctypes.CDLL(path)
    native._declare(lib)
    if lib.k3_fp4_kernels_version() != native.ABI:
        raise SystemExit(f"{path}: ABI {lib.k3_fp4_kernels_version()} != {native.ABI}")
    native._lib, native._tried = lib, True


# -- vllm target: the sharded_state reader (shard --check, verify) and its writer ----
def build_vllm(root: Path) -> tuple[list[Path], list[Path]]:
    """(written directories, their sources): the plain llama at tp 2 and at tp 1, and the
    int4 one (group 8) at tp 1, as ``shard --target vllm`` writes them."""
    from k3convert.engines.vllm_write import write_vllm

    srcs = build_checkpoints(root / "src")
    by = {p.name: p for p in srcs}
    outs = [write_vllm(src=by["plain"], out=root / "plain-tp2", tp=2).out,
            write_vllm(src=by["plain"], out=root / "plain-tp1").out,
            write_vllm(src=by["int4-asym"], out=root / "int4-tp1").out]  # fmt: skip
    return outs, [by["plain"], by["int4-sym"], by["int4-asym"], by["sharded"]]


def mutate_vllm_dir(d: Path, outside: Path, rng: random.Random) -> str:
    """One edit of a written directory: an index value, a rank or carried file's bytes,
    an added / removed / linked file, or hostile index JSON."""
    from k3convert.engines.vllm_sharded import INDEX

    files = sorted(p for p in d.iterdir() if p.name != INDEX)
    r = rng.random()
    if r < 0.35:
        doc = json.loads((d / INDEX).read_text())
        path = rng.choice(_json_paths(doc)[1:])
        old = _get(doc, path)
        _set(doc, path, odd_value(rng, old))
        (d / INDEX).write_text(json.dumps(doc))
        return f"index: {'/'.join(map(str, path))} {_short(old)} -> {_short(_get(doc, path))}"
    if r < 0.4:
        (d / INDEX).write_text(rng.choice([deep_json(rng), "", "{", '{"format": NaN}', "[]"]))
        return "index: hostile JSON"
    if r < 0.65:
        f = rng.choice([p for p in files if p.suffix == ".safetensors"])
        blob, what = mutate_st(f.read_bytes(), rng)
        f.write_bytes(blob)
        return f"{f.name}: {what}"
    if r < 0.75:
        f = rng.choice([p for p in files if p.suffix != ".safetensors"])
        blob = bytearray(f.read_bytes())
        blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(blob))
        return f"{f.name}: one bit flipped"
    if r < 0.85:
        f = rng.choice(files)
        extra = rng.choice(
            ["model-rank-0-part-1.safetensors", "model-rank-9-part-0.safetensors",
             "model.safetensors", "notes.txt", "generation_config.json"]
        )  # fmt: skip
        (d / extra).write_bytes(f.read_bytes())
        return f"added {extra} (a copy of {f.name})"
    f = rng.choice(files)
    f.unlink()
    if rng.random() < 0.5:
        f.symlink_to(outside / f.name)
        return f"{f.name} -> symlink to the pristine copy"
    return f"removed {f.name}"


def verify_vllm_dir(d: Path, template: Pristine) -> None:
    """shard --check, then verify's inverse mapping of every tensor; an accepted
    directory must hold the written bytes (the index may differ in what it does not
    bind)."""
    from k3convert.engines.vllm_sharded import INDEX
    from k3convert.engines.vllm_source import VllmSource

    src = VllmSource(d)  # check_vllm first
    for name in src.names():
        src.get(name)
    for p in d.iterdir():
        if p.name == INDEX:
            continue
        want = template.files.get(Path(p.name))
        if p.is_symlink() or want is None or p.read_bytes() != want:
            raise Mismatch(f"accepted a directory whose {p.name} is not the one written")


def _tree(d: Path) -> dict:
    return {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() else None)
            for p in sorted(d.iterdir())}  # fmt: skip


def write_vllm_mutated(src: Path, out: Path, tp: int) -> None:
    """The writer over a mutated source: refused, or its output passes its own check;
    the source is never changed and nothing is left beside OUT on a refusal."""
    from k3convert.engines.vllm_index import check_vllm
    from k3convert.engines.vllm_write import write_vllm

    before = _tree(src)

    def untouched() -> None:
        if _tree(src) != before:
            raise Mismatch("the writer changed its source directory")
        left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
        if left:
            raise Mismatch(f"the writer left {left} beside OUT")

    try:
        write_vllm(src=src, out=out, tp=tp, force=True)
    except K3Error:
        untouched()
        raise
    untouched()
    try:
        check_vllm(out)
    except K3Error as e:
        raise Mismatch(f"the writer accepted a source its own check then refuses: {e}") from e


class VllmFuzzer:
    target = "vllm"

    def __init__(self, work: Path):
        outs, srcs = build_vllm(work / "templates")
        self.outs = [Pristine(o) for o in outs]
        self.srcs = [Pristine(s) for s in srcs]
        self.work = work

    def iteration(self, i: int, rng: random.Random, tally: Tally) -> str:
        if rng.random() < 0.6:
            t = rng.choice(self.outs)
            d = t.restore(self.work / "case" / t.template.name)
            what = f"[read {t.template.name}] " + mutate_vllm_dir(d, t.template, rng)
            tally.ops[f"read {t.template.name}"] += 1
            classify(tally, i, what, lambda: verify_vllm_dir(d, t))
            return what
        t = rng.choice(self.srcs)
        d = t.restore(self.work / "src" / t.template.name)
        what = f"[write {t.template.name}] " + mutate_checkpoint(d, t.template, rng)
        tally.ops[f"write {t.template.name}"] += 1
        tp = rng.choice([1, 2])
        out = self.work / "out" / "o"
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        classify(tally, i, what + f" (tp {tp})", lambda: write_vllm_mutated(d, out, tp))
        return what


# -- driver ---------------------------------------------------------------------------
FUZZERS = {"checkpoint": CheckpointFuzzer, "stream": StreamFuzzer, "native": NativeFuzzer,
           "vllm": VllmFuzzer}  # fmt: skip


def iteration_rng(seed: int, target: str, i: int) -> random.Random:
    return random.Random(f"{seed}:{target}:{i}")


def run(
    target: str,
    *,
    seed: int = 0,
    iterations: int | None = None,
    seconds: float | None = None,
    work: Path | None = None,
    only: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Tally:
    """Fuzz ``target`` for ``iterations`` (or ``seconds``); the counts of what happened."""
    if iterations is None and seconds is None and only is None:
        iterations = 200
    tally = Tally(target, seed)
    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="k3fuzz-")))
        fz = FUZZERS[target](Path(work) / target)
        t0 = time.perf_counter()
        if only is not None:
            indices: Iterable[int] = [only]
        elif iterations is not None:
            indices = range(iterations)
        else:
            indices = itertools.count()
        for i in indices:
            if only is None and seconds is not None and time.perf_counter() - t0 >= seconds:
                break
            crashes = tally.n_crashes
            try:
                what = fz.iteration(i, iteration_rng(seed, target, i), tally)
            except Exception as e:  # a bug of this harness, not of the reader
                raise RuntimeError(
                    f"fuzz harness failed in iteration {i} of --target {target} --seed {seed}"
                ) from e
            if log is not None:
                log(f"{i}: {'CRASH ' if tally.n_crashes > crashes else ''}{what}")
        tally.seconds = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--iterations", type=int)
    g.add_argument("--seconds", type=float)
    g.add_argument("--replay", type=int, help="run only iteration I (of --seed)")
    ap.add_argument("--target", choices=[*FUZZERS, "both"], default="both")
    ap.add_argument("--verbose", action="store_true", help="tracebacks; each mutation")
    ap.add_argument(
        "--native-lib",
        help="--target native: a build of fp4_kernels.c to test (e.g. with "
        "-fsanitize=address,undefined) instead of the package's",
    )
    a = ap.parse_args(argv)
    if a.native_lib:
        load_native_library(a.native_lib)
    targets = TARGETS if a.target == "both" else (a.target,)
    bad = 0
    for t in targets:
        tally = run(
            t,
            seed=a.seed,
            iterations=a.iterations,
            seconds=a.seconds,
            only=a.replay,
            log=print if a.verbose else None,
        )
        print(tally.report(verbose=a.verbose))
        bad += tally.n_crashes
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
