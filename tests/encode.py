"""Re-encode test checkpoints in public release formats, independently of k3convert.

The readers under test must understand what real releases ship, so the fixtures in
these formats are written from the formats' public descriptions, never with k3convert:

- DeepSeek-V3 / Kimi-K2 FP8-block: ``weight`` float8_e4m3fn plus ``weight_scale_inv``
  float32 ``[ceil(out/128), ceil(in/128)]`` (partial edge blocks), dequantized as
  ``weight * scale_inv`` per block; optionally UE8M0 (power-of-two) scales, stored as
  float32 or as float8_e8m0fnu (DeepSeek-V3.1 ``scale_fmt: ue8m0``).
- compressed-tensors ``pack-quantized`` int-N with group scales, as shipped for
  Kimi-K2-Thinking (``weight_packed`` int32, ``weight_scale`` bf16 ``[out, in/32]``,
  ``weight_shape``, and for asymmetric schemes ``weight_zero_point`` packed along dim 0).
  The packing is compressed-tensors' own ``pack_to_int32``.
- sharded checkpoints with ``model.safetensors.index.json``, torch ``.bin`` files, and
  raw safetensors header editing for crafting corrupt files.

Source tensors are read with safetensors' ``safe_open``; nothing here imports k3convert.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# -- raw safetensors ----------------------------------------------------------------

#: safetensors dtype string -> torch dtype (from the format description)
ST_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header dict incl. ``__metadata__``, data region bytes) of a .safetensors file."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(
    path: Path, header: dict | str | bytes, data: bytes, *, header_len: int | None = None
) -> None:
    """Write a .safetensors file from a header and a data region, no validation at all.

    ``header`` may be a dict or the literal JSON text (to write duplicate keys). The
    header is space-padded to a multiple of 8 bytes, or to exactly ``header_len``.
    """
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    raw = header.encode() if isinstance(header, str) else header
    target = header_len if header_len is not None else math.ceil(len(raw) / 8) * 8
    if len(raw) > target:
        raise ValueError(f"header is {len(raw)} bytes, more than {target}")
    raw += b" " * (target - len(raw))
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def raw_tensor(path: Path, name: str) -> torch.Tensor:
    """Decode one tensor straight from the file's bytes (no safetensors, no k3convert)."""
    header, data = read_raw(path)
    e = header[name]
    b0, b1 = e["data_offsets"]
    buf = bytearray(data[b0:b1])
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return t.view(ST_DTYPES[e["dtype"]]).reshape(e["shape"]).clone()


# -- reading and writing checkpoint directories ----------------------------------------


def weight_files(src: Path) -> list[Path]:
    """The .safetensors files of a directory (through its index when there is one)."""
    idx = src / "model.safetensors.index.json"
    if idx.is_file():
        wm = json.loads(idx.read_text())["weight_map"]
        return [src / f for f in dict.fromkeys(wm.values())]
    return sorted(src.glob("*.safetensors"))


def load_state(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, in file then header-offset order."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(src):
        header, _ = read_raw(f)
        header.pop("__metadata__", None)
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        with safe_open(f, "pt") as sf:
            for k in order:
                out[k] = sf.get_tensor(k)
    return out


def load_config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


def copy_aux(src: Path, dst: Path, config: dict | None = None) -> None:
    """Copy non-weight files (generation config, tokenizer...) and write config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith((".safetensors", ".bin")) and "index" not in p.name:
            shutil.copy2(p, dst / p.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))


def save_dir(dst: Path, tensors: dict[str, torch.Tensor], src: Path, config: dict) -> Path:
    """Write ``tensors`` as one model.safetensors next to ``src``'s aux files."""
    copy_aux(src, dst, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return dst


# -- which tensors are Linear weights ----------------------------------------------------

_NOT_LINEAR = re.compile(
    r"(embed_tokens|lm_head|shared_head\.head|norm|patch_embed|pos_emb"
    r"|\.gate\.weight$|e_score_correction_bias)"
)
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def is_linear_weight(name: str, shape) -> bool:
    """A 2-D nn.Linear weight that releases quantize: not embeddings / lm_head / norms /
    router gate / e_score_correction_bias / the vision patch conv."""
    return name.endswith(".weight") and len(shape) == 2 and not _NOT_LINEAR.search(name)


def is_routed_expert(name: str, shape) -> bool:
    return bool(_EXPERT.search(name)) and len(shape) == 2


# -- DeepSeek-V3 FP8 block ---------------------------------------------------------------

E4M3_MAX = 448.0
SCALE_FMTS = ("float32", "ue8m0", "e8m0")


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(x), e)


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (e4m3 [out, in], scale_inv [ceil(out/b0), ceil(in/b1)]).

    scale_inv = amax(block) / 448 (float32), or for ue8m0 the next power of two up,
    stored as float32 ("ue8m0") or float8_e8m0fnu ("e8m0").
    """
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(scale_fmt)
    w = w.float()
    out, inp = w.shape
    b0, b1 = block
    n0, n1 = math.ceil(out / b0), math.ceil(inp / b1)
    padded = torch.zeros(n0 * b0, n1 * b1)
    padded[:out, :inp] = w
    blocks = padded.reshape(n0, b0, n1, b1)
    amax = blocks.abs().amax(dim=(1, 3))  # [n0, n1]
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    scale = amax / E4M3_MAX
    if scale_fmt != "float32":
        scale = _pow2_ceil(scale)
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:out, :inp]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if scale_fmt == "e8m0":
        stored = scale.to(torch.float8_e8m0fnu)
        assert torch.equal(stored.float(), scale), "power-of-two scale not exact in e8m0"
        scale = stored
    return q, scale


def encode_fp8_block(
    src: Path,
    dst: Path,
    *,
    block: tuple[int, int] = (128, 128),
    scale_fmt: str = "float32",
    select: Callable[[str, tuple], bool] = is_linear_weight,
) -> Path:
    """Re-encode ``src`` as a DeepSeek-V3 FP8-block checkpoint in ``dst``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in load_state(src).items():
        if select(name, tuple(t.shape)):
            q, s = fp8_block_quantize(t, block, scale_fmt)
            out[name] = q
            out[name.removesuffix("weight") + "weight_scale_inv"] = s
        else:
            out[name] = t
    cfg = load_config(src)
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if scale_fmt != "float32":
        qc["scale_fmt"] = "ue8m0"
    cfg["quantization_config"] = qc
    return save_dir(dst, out, src, cfg)


# -- compressed-tensors pack-quantized int-N ------------------------------------------


def int_group_quantize(
    w: torch.Tensor,
    num_bits: int = 4,
    group_size: int = 32,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """w: [out, in] -> q int8 [out, in], scale [out, in/g] (scale_dtype), zero_point int8.

    The min-max rule of compressed-tensors: symmetric scale = absmax / ((2**b - 1) / 2);
    asymmetric scale = (max - min) / (2**b - 1), zero_point = round(qmin - min / scale).
    Scales are rounded to ``scale_dtype`` *before* quantizing, so the stored scale is
    the one the values were quantized with.
    """
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"in_features {inp} not divisible by group_size {group_size}")
    qmin, qmax = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    g = w.float().reshape(out, inp // group_size, group_size)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.full_like(scale, 1e-8), scale)
    scale = scale.to(scale_dtype).float()
    if symmetric:
        zp = torch.zeros_like(scale)
    else:
        zp = torch.round(qmin - lo / scale).clamp(qmin, qmax)
    q = torch.round(g / scale[..., None] + zp[..., None]).clamp(qmin, qmax)
    return {
        "q": q.reshape(out, inp).to(torch.int8),
        "scale": scale.to(scale_dtype),
        "zero_point": zp.to(torch.int8),
    }


def pack_quantized_config(
    num_bits: int, group_size: int, symmetric: bool, ignore: list[str]
) -> dict:
    """quantization_config as compressed-tensors writes it (Kimi-K2-Thinking layout)."""
    weights = {
        "num_bits": num_bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def encode_pack_quantized(
    src: Path,
    dst: Path,
    *,
    scope: str = "experts",
    num_bits: int = 4,
    group_size: int = 32,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Re-encode ``src`` in compressed-tensors pack-quantized int-N in ``dst``.

    scope "experts": routed experts only (as Kimi-K2-Thinking); "linear": every Linear
    weight whose in_features divides by the group size. Every other Linear module is
    named in ``ignore``.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    pick = {"experts": is_routed_expert, "linear": is_linear_weight}[scope]
    out: dict[str, torch.Tensor] = {}
    ignore: list[str] = []
    for name, t in load_state(src).items():
        shape = tuple(t.shape)
        if pick(name, shape) and shape[1] % group_size == 0:
            q = int_group_quantize(t, num_bits, group_size, symmetric, scale_dtype)
            base = name.removesuffix("weight")
            out[base + "weight_packed"] = pack_to_int32(q["q"], num_bits)
            out[base + "weight_scale"] = q["scale"]
            out[base + "weight_shape"] = torch.tensor(shape, dtype=torch.int64)
            if not symmetric:
                out[base + "weight_zero_point"] = pack_to_int32(
                    q["zero_point"], num_bits, packed_dim=0
                )
        else:
            out[name] = t
            if name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name:
                ignore.append(name.removesuffix(".weight"))
    cfg = load_config(src)
    cfg["quantization_config"] = pack_quantized_config(num_bits, group_size, symmetric, ignore)
    return save_dir(dst, out, src, cfg)


# -- layout changes ----------------------------------------------------------------------


def reshard(src: Path, dst: Path, n_files: int = 3, *, interleave: bool = False) -> Path:
    """Split ``src`` into ``n_files`` safetensors files plus model.safetensors.index.json.

    Contiguous chunks by default; ``interleave`` deals tensors round-robin, so a weight
    and its scale land in different files.
    """
    state = load_state(src)
    names = list(state)
    if interleave:
        chunks = [names[i::n_files] for i in range(n_files)]
    else:
        per = math.ceil(len(names) / n_files)
        chunks = [names[i * per : (i + 1) * per] for i in range(n_files)]
    copy_aux(src, dst)
    weight_map: dict[str, str] = {}
    total = 0
    for i, chunk in enumerate(chunks):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {k: state[k].contiguous() for k in chunk}
        save_file(part, dst / fname, metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def to_bin(src: Path, dst: Path, n_files: int = 1) -> Path:
    """Write ``src`` as torch.save zip checkpoint(s) (pytorch_model.bin [+ index])."""
    state = load_state(src)
    copy_aux(src, dst)
    if n_files == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    names = list(state)
    per = math.ceil(len(names) / n_files)
    weight_map = {}
    for i in range(n_files):
        fname = f"pytorch_model-{i + 1:05d}-of-{n_files:05d}.bin"
        chunk = names[i * per : (i + 1) * per]
        torch.save({k: state[k] for k in chunk}, dst / fname)
        weight_map.update(dict.fromkeys(chunk, fname))
    (dst / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


def append_mtp_layer(src: Path, dst: Path, seed: int = 0) -> Path:
    """A DeepSeek-V3 checkpoint plus one multi-token-prediction layer, as released.

    transformers neither builds nor saves MTP layers, so layer ``N`` (N =
    num_hidden_layers) is written by hand: a copy of the last decoder layer's tensors
    (perturbed) plus ``embed_tokens / enorm / hnorm / eh_proj / shared_head.{norm,head}``.
    config.json gets ``num_nextn_predict_layers: 1``.
    """
    g = torch.Generator().manual_seed(seed)
    state = load_state(src)
    cfg = load_config(src)
    n, h, v = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = dict(state)
    for k, t in state.items():
        if k.startswith(last):
            out[new + k[len(last) :]] = t + 0.01 * torch.randn(t.shape, generator=g)
    extra = {
        "embed_tokens.weight": (v, h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
    }
    for k, shape in extra.items():
        out[new + k] = torch.randn(shape, generator=g)
    cfg["num_nextn_predict_layers"] = 1
    return save_dir(dst, out, src, cfg)
