"""``k3convert forward``: run the embedded runtime on token ids and show the next tokens.

A smoke test of a checkpoint (original, quantized or, later, sharded) without
transformers: ids on the command line or in a safetensors file, optional images, top-K
next tokens per sequence (decoded when a tokenizer sits next to the weights and
transformers is importable), optional float32 logits saved for offline comparison.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..checkpoint.bounded import read_json
from ..checkpoint.output import guard_out, probe_writable, write_error
from ..checkpoint.safetensors_io import SafetensorsWriter
from ..checkpoint.tokenizer_files import (
    TOKENIZER_FILES,
    check_tokenizer_files,
    is_panic,
    quiet_panics,
)
from ..errors import CheckpointError, ConfigError, K3Error, OutputError
from ..sources import open_source
from ..stream import Stream
from .parallel import ParallelRuntime
from .ranks import stream_ranks
from .runtime import Runtime, parse_dtype


def parse_ids(text: str) -> torch.Tensor:
    """'1 2 3' -> [[1, 2, 3]]; sequences of equal length may be separated by ';'."""
    rows = [r for r in text.split(";") if r.strip()]
    if not rows:
        raise ConfigError('--ids is empty; give token ids like --ids "1 2 3".')
    seqs = []
    for r in rows:
        toks = [t for t in re.split(r"[\s,]+", r.strip()) if t]
        try:
            seqs.append([int(t) for t in toks])
        except ValueError:
            bad = next(t for t in toks if not re.fullmatch(r"-?\d+", t))
            raise ConfigError(
                f"--ids: '{bad}' is not an integer token id; give ids like --ids \"1 2 3\"."
            ) from None
    big = next((t for s in seqs for t in s if not 0 <= t < 2**63), None)
    if big is not None:
        raise ConfigError(
            f"--ids: {str(big)[:30]} is not a token id (ids are integers in [0, vocab size))."
        )
    if len({len(s) for s in seqs}) != 1:
        raise ConfigError(
            f"--ids: sequences have different lengths ({', '.join(str(len(s)) for s in seqs)}); "
            f"use --ids-file with an attention_mask for ragged batches."
        )
    return torch.tensor(seqs, dtype=torch.long)


def load_safetensors(path: str | os.PathLike, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p}: no such file.")
    try:
        return load_file(str(p))
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{what} {p}: not a readable safetensors file ({e}).") from e


def load_ids_file(path, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids [B, S] integer, attention_mask [B, S] or None) from a safetensors
    file; a 1-D file is one sequence. Shapes and dtypes are checked, with ``what`` (the
    option) in every message."""
    d = load_safetensors(path, what)
    ids = need_tensor(d, "input_ids", path, what)
    mask = d.get("attention_mask")
    if ids.ndim == 1:
        ids = ids[None]
        mask = mask[None] if mask is not None and mask.ndim == 1 else mask
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ConfigError(
            f"{what} {path}: input_ids must be integer [batch, seq], got {ids.dtype} "
            f"{tuple(ids.shape)}."
        )
    if ids.numel() == 0:
        raise ConfigError(
            f"{what} {path}: input_ids {tuple(ids.shape)} is empty; give at least one "
            f"sequence of at least one token."
        )
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ConfigError(
            f"{what} {path}: attention_mask {tuple(mask.shape)} does not match input_ids "
            f"{tuple(ids.shape)}."
        )
    return ids, mask


def need_tensor(d: dict, key: str, path, what: str) -> torch.Tensor:
    if key not in d:
        raise ConfigError(
            f"{what} {path}: no tensor '{key}' (it holds {', '.join(sorted(d)) or 'nothing'})."
        )
    return d[key]


def load_tokenizer(src: Path) -> tuple[object | None, str | None]:
    """(tokenizer or None, a note for the report). Never runs code from the model
    directory: a tokenizer that needs its own Python (an ``auto_map``) is not loaded, nor
    one whose files are not regular files under their size cap (a FIFO would block
    transformers' read, a huge file eat memory)."""
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        return None, None
    try:
        custom = _needs_custom_code(src)
    except K3Error as e:  # a broken tokenizer must not hide the logits; ids are printed
        return None, f"tokenizer: not loaded ({str(e)[:200]}); showing token ids"
    if custom:
        return None, (
            "tokenizer: needs custom code from the model directory (auto_map), which "
            "k3convert never runs; showing token ids"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, None
    try:
        with quiet_panics():  # (a Rust panic's backtrace kept off the terminal)
            tok = AutoTokenizer.from_pretrained(
                str(src), trust_remote_code=False, local_files_only=True
            )
            tok.encode("k3convert")  # a pattern that panics does so on first use
    except BaseException as e:  # a broken tokenizer must not hide the logits; ids shown
        if not isinstance(e, Exception) and not is_panic(e):
            raise  # (KeyboardInterrupt, SystemExit)
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return None, f"tokenizer: not loaded ({msg}); showing token ids"
    return tok, None


def _needs_custom_code(src: Path) -> bool:
    """True if tokenizer_config.json or config.json maps a tokenizer class to code. Both
    are read bounded and strict (:mod:`..checkpoint.bounded`), and every tokenizer file
    present must be a regular file under the tokenizer size cap: CheckpointError if not."""
    check_tokenizer_files(src, CheckpointError)
    for name, kind in (("tokenizer_config.json", "tokenizer"), ("config.json", "config")):
        f = src / name
        if not os.path.lexists(f):
            continue
        data = read_json(f, kind, CheckpointError)
        amap = data.get("auto_map")
        if name == "tokenizer_config.json" and amap:
            return True
        if isinstance(amap, dict) and "AutoTokenizer" in amap:
            return True
    return False


def run_forward(
    *,
    src: str | os.PathLike,
    ids: str | None = None,
    ids_file: str | os.PathLike | None = None,
    pixel_values: str | os.PathLike | None = None,
    dtype: str = "fp32",
    save_logits: str | os.PathLike | None = None,
    top: int = 5,
    device: str = "cpu",
    act_quant: bool = True,
) -> str:
    """Forward SRC on the given ids; returns the report text (top-K next tokens).

    act_quant=False runs a quantized checkpoint without activation fake-quantization
    (dequantized weights only), to isolate the weight error."""
    if (ids is None) == (ids_file is None):
        raise ConfigError('give exactly one of --ids "1 2 3" or --ids-file F.safetensors.')
    if not isinstance(top, int) or top < 1:
        raise ConfigError(f"--top must be a positive integer, got {top!r}.")
    compute = parse_dtype(dtype)
    mask = None
    if ids is not None:
        input_ids = parse_ids(ids)
    else:
        input_ids, mask = load_ids_file(ids_file, "--ids-file")
    pv = grid = None
    if pixel_values is not None:
        d = load_safetensors(pixel_values, "--pixel-values")
        pv = need_tensor(d, "pixel_values", pixel_values, "--pixel-values")
        grid = need_tensor(d, "image_grid_thw", pixel_values, "--pixel-values")
    if save_logits is not None:
        _check_logits_path(Path(save_logits), Path(src))
    ckpt = open_source(src)  # a stream: its config.json checked against the manifest
    if isinstance(ckpt, Stream):
        ckpt.check_carried()  # the tokenizer the report decodes with, too; before the run
    aq = None if act_quant else False
    if getattr(ckpt, "world", 1) != 1:
        # every rank of the stream, simulated in this process (k3convert verify compares)
        rt = ParallelRuntime(stream_ranks(ckpt), device=device, dtype=compute, act_quant=aq)
    else:
        rt = Runtime(ckpt, device=device, dtype=compute, act_quant=aq)
    with rt:
        logits = rt.forward(input_ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid)
    if save_logits is not None:
        _save(logits, Path(save_logits))
    return _report(Path(src), rt, input_ids, mask, logits, top, dtype, device, save_logits)


def _logits_tmp(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def _check_logits_path(out: Path, src: Path) -> None:
    """Before the (long) forward: the path is not in the source, and can be written."""
    guard_out(out, [src])
    if out.is_dir():
        raise OutputError(f"--save-logits {out}: is a directory; give a file name.")
    if not out.parent.is_dir():
        raise OutputError(
            f"--save-logits {out}: directory {out.parent} does not exist; create it first."
        )
    probe_writable(out)


def _save(logits: torch.Tensor, out: Path) -> None:
    """float32 logits as safetensors, written to a temp name and renamed (atomic)."""
    t = logits.float().contiguous().cpu()
    tmp = _logits_tmp(out)
    try:
        with SafetensorsWriter(tmp, [("logits", t.dtype, tuple(t.shape))], {"format": "pt"}) as w:
            w.write("logits", t)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(e, out, "--save-logits: writing") from e


def _act_line(rt: Runtime) -> str:
    kv = ""
    if rt.kv_scheme is not None:
        state = "fake-quantized" if rt.kv_quant else "NOT quantized (--no-act-quant)"
        kv = f"; KV cache: {state} (fp8 e4m3, calibrated per-layer scales)"
    return _linear_line(rt) + kv


def _linear_line(rt: Runtime) -> str:
    if not rt.act_specs:
        return "activations: not quantized by the checkpoint"
    kinds = sorted(
        {
            f"{s.type}{s.num_bits} {s.strategy}{'' if s.dynamic else ' static'}"
            for s in rt.act_specs.values()
        }
    )
    n = len(rt.act_specs)
    state = "fake-quantized" if rt.act_quant else "NOT quantized (--no-act-quant)"
    line = f"activations: {state}; checkpoint: {', '.join(kinds)} on {n} linear(s)"
    experts = sum(1 for name in rt.act_specs if re.search(r"\.experts\.\d+\.", name))
    if experts and rt.act_quant and not rt.act_quant_experts:
        line += f" ({experts} routed-expert linears left unquantized, as transformers does)"
    return line


def _report(src, rt, input_ids, mask, logits, top, dtype, device, saved) -> str:
    tok, note = load_tokenizer(src if src.is_dir() else src.parent)
    b, s = input_ids.shape
    k = min(top, logits.shape[-1])
    lines = [
        f"{src}: {rt.arch.name}, {rt.num_layers} layers, {dtype} on {device}; input [{b}, {s}]",
        _act_line(rt),
        *([note] if note else []),
    ]
    for row in range(b):
        if mask is not None:
            valid = mask[row].nonzero()
            if len(valid) == 0:
                lines.append(f"sequence {row}: all padding, skipped")
                continue
            last = int(valid[-1])
        else:
            last = s - 1
        lg = logits[row, last].float()
        probs = lg.softmax(-1)
        p, idx = probs.topk(k)
        lines.append(f"sequence {row} (next token after position {last}):")
        for rank, (pi, ti) in enumerate(zip(p.tolist(), idx.tolist(), strict=True), 1):
            text = f" {tok.decode([ti])!r}" if tok is not None else ""
            lines.append(f"  {rank:>2}. id {ti:>7}{text}  p={pi:.4f}  logit={lg[ti].item():.4f}")
    if saved is not None:
        lines.append(f"logits [{b}, {s}, {logits.shape[-1]}] float32 saved to {saved}")
    return "\n".join(lines)
