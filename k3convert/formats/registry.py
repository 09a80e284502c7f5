"""The encodings: one :class:`Encoding` per storage format, detection and the
quantization_config each implies (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .base import (
    ACTIVATION,
    ACTIVATION_PARTS,
    FP8_DTYPES,
    GLOBAL_SCALE,
    MX_GROUP,
    NV_GROUP,
    PART_ROLES,
    SCALE,
    SHAPE,
    VALUES,
    ZERO_POINT,
    PartSig,
    QuantParams,
)
from .fp4 import decode_mxfp4, decode_nvfp4
from .intn import unpack_int32


# -- scale tiling ---------------------------------------------------------------------
def scale_block(
    scale_shape: tuple[int, ...], shape: tuple[int, ...], block: tuple[int, int] | None
) -> tuple[int, int]:
    """Rows x cols of weight covered by one scale; ValueError if they do not tile.

    ``block`` comes from config.json when known; otherwise ``ceil(dim / scale_dim)``,
    which is exact whenever the dims divide.
    """
    out, inp = shape
    if block is not None and min(block) < 1:
        raise ValueError(f"block {tuple(block)} is not positive")
    if len(scale_shape) == 0 or math.prod(scale_shape) == 1:
        return out, inp
    s0, s1 = (scale_shape[0], 1) if len(scale_shape) == 1 else tuple(scale_shape[:2])
    if len(scale_shape) > 2:
        raise ValueError(f"scale shape {tuple(scale_shape)} is not 1-D or 2-D")
    if not block and 0 in (s0, s1, out, inp):
        raise ValueError(f"scale shape {tuple(scale_shape)} or weight {tuple(shape)} is empty")
    b0 = block[0] if block else math.ceil(out / s0)
    b1 = block[1] if block else math.ceil(inp / s1)
    if b0 == 1 and s0 == out and block and block[0] == 1 and s1 == 1:
        b1 = inp  # per-channel scale under a group config
    if math.ceil(out / b0) != s0 or math.ceil(inp / b1) != s1:
        raise ValueError(
            f"scale shape {tuple(scale_shape)} does not tile weight {tuple(shape)} in "
            f"blocks of {b0}x{b1}"
        )
    return b0, b1


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None):
    """Broadcast a per-block scale to ``shape`` [out, in] (float32).

    scale: [] | [1] | [out, 1] | [out, n_groups] | [ceil(out/b0), ceil(in/b1)]
    """
    out, inp = shape
    b0, b1 = scale_block(tuple(scale.shape), shape, block)
    s = scale.float()
    if (b0, b1) == (out, inp):
        return s.reshape(1, 1).expand(out, inp)
    s = s.reshape(math.ceil(out / b0), math.ceil(inp / b1))
    return s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]


def infer_num_bits(n_cols: int, packed_cols: int) -> int | None:
    """The unique bit width b with ceil(n_cols*b/32) == packed_cols, or None."""
    hits = [b for b in range(1, 9) if math.ceil(n_cols * b / 32) == packed_cols]
    return hits[0] if len(hits) == 1 else None


# -- how a part follows a split ---------------------------------------------------------
@dataclass(frozen=True)
class AxisMap:
    """How logical index x along the split dim maps onto one part's ``dim``.

    part index = ceil(ceil(x / div) * bits / word_bits) when ``bits`` (packed: int-N in
    int32 words, FP4 in bytes), else ceil(x / div). ``what`` names the granule a boundary
    must not cut, for the error message.
    """

    dim: int
    div: int = 1
    bits: int | None = None
    what: str = ""
    word_bits: int = 32

    @property
    def align(self) -> int:
        if self.bits is None:
            return self.div
        return self.div * (self.word_bits // math.gcd(self.word_bits, self.bits))

    def index(self, x: int) -> int:
        q = -(-x // self.div)
        return -(-q * self.bits // self.word_bits) if self.bits else q


COPY = "copy"  # the part does not vary along the split dim: every piece holds all of it
LOCAL_SHAPE = "shape"  # the part stores the logical shape: every piece holds its local shape


class UnsplittableError(ValueError):
    """A part that no split can cut (act-order ``weight_g_idx``)."""


# -- the registry -----------------------------------------------------------------------
@dataclass(frozen=True)
class PartSpec:
    """One part an encoding stores: suffix, role, allowed dtypes (None: any), required."""

    name: str
    role: str
    dtypes: tuple[torch.dtype, ...] | None = None
    required: bool = True


Dequantizer = Callable[[Mapping[str, torch.Tensor], QuantParams], torch.Tensor]


@dataclass(frozen=True)
class Encoding:
    """One way a logical weight is stored (see the module docstring).

    Detected when every required part is present, no ``forbidden`` one is, and every
    present part whose :class:`PartSpec` constrains ``dtypes`` for detection
    (``detect_dtypes``) has one of them. ``scale_part`` holds the scales; ``shape_part``
    is where the logical shape comes from ("weight": that part's shape; "weight_shape":
    that part's data, 2 ints; "weight_packed": FP4 bytes, [rows, 2 * cols]).
    ``default_block`` applies when config.json does not say the block size; ``group``
    is the fixed group of an FP4 format (config.json cannot change it). ``packing``:
    None (one value per element), "int32" (int-N words) or "fp4" (two E2M1 per byte).
    """

    name: str
    parts: tuple[PartSpec, ...]
    forbidden: tuple[str, ...]
    dequantize: Dequantizer
    description: str
    scale_part: str = "weight_scale"
    shape_part: str = "weight"
    default_block: tuple[int, int] | None = None
    group: int | None = None
    packing: str | None = None
    ct_formats: tuple[str, ...] = ()
    detect_dtypes: tuple[str, ...] = ("weight",)
    storage_label: str | None = None
    weight_args: dict | None = None
    #: dtypes the dequantizer computes in directly (``dtype=`` keyword), exactly
    direct_dtypes: tuple[torch.dtype, ...] = ()

    def dequantize_to(
        self, parts: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The dequantized tensor in ``dtype`` (float32 when None): computed in it where
        that is exact (MXFP4 in bfloat16), else in float32 and converted."""
        dtype = dtype or torch.float32
        if dtype in self.direct_dtypes:
            return self.dequantize(parts, q, dtype=dtype)
        return self.dequantize(parts, q).to(dtype)

    # -- what older code reads off an encoding --------------------------------------------
    @property
    def required(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts if p.required)

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts if not p.required)

    def spec(self, part: str) -> PartSpec | None:
        return next((p for p in self.parts if p.name == part), None)

    @property
    def weight_dtypes(self) -> tuple[torch.dtype, ...] | None:
        s = self.spec("weight")
        return s.dtypes if s is not None else None

    @property
    def values_part(self) -> str:
        return next(p.name for p in self.parts if p.role == VALUES)

    # -- detection ---------------------------------------------------------------------
    def matches(self, parts: PartSig) -> bool:
        if not all(p in parts for p in self.required):
            return False
        if any(p in parts for p in self.forbidden):
            return False
        for name in self.detect_dtypes:
            s = self.spec(name)
            known = name in parts and s is not None and s.dtypes is not None
            if known and parts[name][1] not in s.dtypes:
                return False
        return True

    # -- logical shape, quant params, geometry ------------------------------------------
    def stored_shape(self, parts: PartSig) -> tuple[int, ...] | None:
        """The logical shape from the parts' shapes alone (None: it is stored as data)."""
        if self.shape_part == "weight":
            return tuple(parts["weight"][0])
        if self.shape_part == "weight_packed":
            shp = tuple(parts["weight_packed"][0])
            return (shp[0], 2 * shp[1]) if len(shp) == 2 else shp
        return None

    def resolve_quant(self, logical: str, parts: PartSig, shape, q: QuantParams) -> QuantParams:
        """config.json's params for this tensor, completed from what is stored.

        FP4 formats fix their bit width and group (the config cannot change them);
        pack-quantized infers the bit width from the packed words and refuses a config
        that disagrees; others take the default block when the config has none.
        """
        from dataclasses import replace

        if self.group is not None:
            extra = dict(q.extra or {})
            extra.setdefault("type", "float")
            extra["strategy"] = "group" if self.name == MXFP4 else "tensor_group"
            return QuantParams(4, (1, self.group), True, extra)
        if q.block is None and self.default_block is not None:
            q = replace(q, block=self.default_block)
        if self.packing == "int32":
            pk = parts["weight_packed"][0]
            bits = infer_num_bits(shape[-1], pk[-1]) if len(pk) == 2 else None
            if q.num_bits is None:
                q = replace(q, num_bits=bits)
            elif bits is not None and bits != q.num_bits:
                raise CheckpointError(
                    f"'{logical}' packed shape {tuple(pk)} holds {bits}-bit values but "
                    f"config.json says num_bits={q.num_bits}."
                )
        return q

    def problem(self, logical: str, shape, parts: PartSig, q: QuantParams) -> str | None:
        """What is wrong with the stored parts of ``logical`` (None when they fit).

        Checks the scale tiling for every encoding, and for FP4 the exact dtypes and
        shapes (packed bytes, one scale per group, a one-element global scale).
        """
        if len(shape) != 2:
            return f"encoded tensor '{logical}' must be 2-D, got {tuple(shape)}"
        if self.packing == "fp4":
            return _fp4_problem(self, logical, tuple(shape), parts)
        try:
            scale_block(tuple(parts[self.scale_part][0]), tuple(shape), q.block)
        except ValueError as e:
            return str(e)
        return None

    # -- split --------------------------------------------------------------------------
    def axis_maps(self, m, d: int) -> dict[str, AxisMap | str]:
        """Per part of TensorMeta ``m``: how it follows a cut of logical dim ``d``."""
        return _axis_maps(self, m, d)


def _name_of(logical: str, part: str) -> str:
    return f"{logical.removesuffix('.weight')}.{part}"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fp4_problem(enc: Encoding, logical: str, shape, parts: PartSig) -> str | None:
    out, inp = shape
    g = enc.group
    pshape, pdt = parts["weight_packed"]
    if pdt != torch.uint8 or len(pshape) != 2:
        return (
            f"'{_name_of(logical, 'weight_packed')}' must be uint8 [out, in/2] (two FP4 "
            f"E2M1 values per byte) but is {_dt(pdt)}{list(pshape)}"
        )
    sshape, sdt = parts["weight_scale"]
    want_dt = torch.uint8 if enc.name == MXFP4 else torch.float8_e4m3fn
    want = [out, inp // g]
    what = "E8M0 exponent" if enc.name == MXFP4 else "e4m3 scale"
    if inp % g:
        return (
            f"'{logical}' has {inp} input columns (from '{_name_of(logical, 'weight_packed')}' "
            f"{list(pshape)}), not a multiple of the {enc.name} group of {g}"
        )
    if sdt != want_dt or list(sshape) != want:
        return (
            f"'{_name_of(logical, 'weight_scale')}' is {_dt(sdt)}{list(sshape)}, expected "
            f"{_dt(want_dt)}{want} (one {what} per {g} values of the {out} x {inp} weight)"
        )
    if enc.name == NVFP4:
        gshape, gdt = parts["weight_global_scale"]
        if gdt != torch.float32 or math.prod(gshape) != 1 or len(gshape) > 1:
            return (
                f"'{_name_of(logical, 'weight_global_scale')}' is {_dt(gdt)}{list(gshape)}, "
                f"expected float32[1]"
            )
    return None


def _scale_map(enc: Encoding, m, part: str, d: int, packed_bits: int | None = None):
    """AxisMap (or COPY) of a scale / zero-point part for logical dim d."""
    pm = m.parts[part]
    if enc.group is not None:  # FP4: a piece holds whole groups, rows freely
        if d == 0:
            return AxisMap(0)
        vals = f"{enc.group} values ({enc.group // 2} bytes)"
        label = enc.storage_label.upper() if enc.storage_label else enc.name
        return AxisMap(1, enc.group, None, f"{label} group of {vals}")
    sshape = tuple(m.parts[enc.scale_part].shape)
    if len(sshape) == 0 or math.prod(sshape) == 1:
        return COPY
    b = scale_block(sshape, tuple(m.shape), m.quant.block)
    s2 = (sshape[0], 1) if len(sshape) == 1 else sshape
    is_block = enc.name == "fp8-block" or (m.quant.extra or {}).get("strategy") == "block"
    if s2[d] == 1 and not is_block:
        return COPY
    if d >= len(pm.shape):
        return COPY
    kind = "FP8 block" if enc.name == "fp8-block" else "quantization group/block"
    what = f"{kind} of {b[0]}x{b[1]}"
    if packed_bits and d == 0:
        rows = b[0] * 32 // math.gcd(32, packed_bits)
        word = f"packed int32 word of {packed_bits}-bit zero points ({rows} rows)"
        return AxisMap(0, b[0], packed_bits, word)
    return AxisMap(d, b[d], None, what)


def _axis_maps(enc: Encoding, m, d: int) -> dict[str, AxisMap | str]:
    out: dict[str, AxisMap | str] = {}
    bits = m.quant.num_bits
    for part, pm in m.parts.items():
        role = PART_ROLES.get(part)
        if role in (ACTIVATION, GLOBAL_SCALE):
            out[part] = COPY
        elif enc.name == PLAIN or part == "weight":
            out[part] = AxisMap(d) if d < len(pm.shape) else COPY
        elif part == "weight_packed":
            if d == 0:
                out[part] = AxisMap(0)
            elif enc.packing == "fp4":
                out[part] = AxisMap(1, 1, 4, "FP4 byte (2 values)", word_bits=8)
            else:
                what = f"packed int32 word ({32 // math.gcd(32, bits)} values)"
                out[part] = AxisMap(1, 1, bits, what)
        elif role == SCALE:
            out[part] = _scale_map(enc, m, part, d)
        elif role == ZERO_POINT:
            packed = bits if enc.packing == "int32" else None
            out[part] = _scale_map(enc, m, part, d, packed)
        elif role == SHAPE:
            out[part] = LOCAL_SHAPE
        else:  # weight_g_idx (act-order): group ids are global; no sound way to cut them
            raise UnsplittableError(
                f"tensor '{m.name}': part '{part}' cannot be split (act-order g_idx); "
                f"replicate it or re-quantize without activation ordering."
            )
    return out


# -- dequantizers -----------------------------------------------------------------------
def _deq_fp8_block(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    w = p["weight"]
    return w.float() * expand_scale(p["weight_scale_inv"], tuple(w.shape), q.block)


def _deq_scaled(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    w = p["weight"].float()
    if "weight_zero_point" in p:
        w = w - expand_scale(p["weight_zero_point"], tuple(w.shape), q.block)
    return w * expand_scale(p["weight_scale"], tuple(w.shape), q.block)


def _packed_shape(p) -> tuple[int, int]:
    ws = p["weight_shape"]
    if isinstance(ws, torch.Tensor):
        return tuple(int(x) for x in ws.tolist())
    return tuple(ws)


def _deq_packed(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:

    out, inp = _packed_shape(p)
    packed = p["weight_packed"]
    bits = q.num_bits or infer_num_bits(inp, packed.shape[-1])
    if bits is None:
        raise ValueError("cannot tell the bit width; config.json has no num_bits for it")
    vals = unpack_int32(packed, bits, (out, inp)).float()
    scale = p["weight_scale"]
    if "weight_zero_point" in p:
        zshape = tuple(scale.shape)
        if len(zshape) != 2 or p["weight_zero_point"].dim() != 2:
            raise ValueError(
                f"zero points {tuple(p['weight_zero_point'].shape)} packed along dim 0 need "
                f"2-D zero points and scales (scale is {zshape})"
            )
        zp = unpack_int32(p["weight_zero_point"], bits, zshape, packed_dim=0)
        vals = vals - expand_scale(zp, (out, inp), q.block)
    return vals * expand_scale(scale, (out, inp), q.block)


def _deq_plain(p: Mapping[str, torch.Tensor], q: QuantParams) -> torch.Tensor:
    return p["weight"]


# -- the formats ----------------------------------------------------------------------
PLAIN = "plain"
MXFP4 = "mxfp4-pack-quantized"
NVFP4 = "nvfp4-pack-quantized"

_U8 = (torch.uint8,)
_MX_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": MX_GROUP,
    "strategy": "group",
    "dynamic": False,
    "scale_dtype": "torch.uint8",
}
_NV_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": NV_GROUP,
    "strategy": "tensor_group",
    "dynamic": False,
    "scale_dtype": "torch.float8_e4m3fn",
}

FORMATS: dict[str, Encoding] = {
    e.name: e
    for e in (
        Encoding(
            PLAIN,
            (PartSpec("weight", VALUES),),
            (),
            _deq_plain,
            "a dense tensor in its stored dtype",
            scale_part="",
        ),
        Encoding(
            "fp8-block",
            (PartSpec("weight", VALUES, FP8_DTYPES), PartSpec("weight_scale_inv", SCALE)),
            ("weight_scale", "weight_packed"),
            _deq_fp8_block,
            "DeepSeek-V3 FP8 e4m3 with one fp32 (or ue8m0) scale per 128x128 block",
            scale_part="weight_scale_inv",
            default_block=(128, 128),
        ),
        Encoding(
            "pack-quantized",
            (
                PartSpec("weight_packed", VALUES),
                PartSpec("weight_scale", SCALE),
                PartSpec("weight_shape", SHAPE),
                PartSpec("weight_zero_point", ZERO_POINT, required=False),
            ),
            ("weight",),
            _deq_packed,
            "compressed-tensors int-N packed into int32 with group/channel scales",
            shape_part="weight_shape",
            packing="int32",
            ct_formats=("pack-quantized",),
        ),
        Encoding(
            "float-quantized",
            (
                PartSpec("weight", VALUES, FP8_DTYPES),
                PartSpec("weight_scale", SCALE),
                PartSpec("weight_zero_point", ZERO_POINT, required=False),
            ),
            ("weight_packed", "weight_scale_inv"),
            _deq_scaled,
            "compressed-tensors FP8 weight with tensor/channel/group/block scales",
            ct_formats=("float-quantized", "naive-quantized"),
        ),
        Encoding(
            "int-quantized",
            (
                PartSpec("weight", VALUES, (torch.int8,)),
                PartSpec("weight_scale", SCALE),
                PartSpec("weight_zero_point", ZERO_POINT, required=False),
            ),
            ("weight_packed", "weight_scale_inv"),
            _deq_scaled,
            "compressed-tensors int8 weight with scales (and optional zero point)",
            ct_formats=("int-quantized", "naive-quantized"),
        ),
        Encoding(
            MXFP4,
            (PartSpec("weight_packed", VALUES, _U8), PartSpec("weight_scale", SCALE, _U8)),
            ("weight", "weight_shape", "weight_global_scale", "weight_zero_point"),
            decode_mxfp4,
            "OCP MXFP4: FP4 E2M1 two per byte, one E8M0 exponent per 32 values",
            shape_part="weight_packed",
            default_block=(1, MX_GROUP),
            group=MX_GROUP,
            packing="fp4",
            ct_formats=(MXFP4,),
            detect_dtypes=("weight_packed", "weight_scale"),
            storage_label="mxfp4",
            weight_args=_MX_ARGS,
            direct_dtypes=(torch.float32, torch.bfloat16),
        ),
        Encoding(
            NVFP4,
            (
                PartSpec("weight_packed", VALUES, _U8),
                PartSpec("weight_scale", SCALE, (torch.float8_e4m3fn,)),
                PartSpec("weight_global_scale", GLOBAL_SCALE, (torch.float32,)),
            ),
            ("weight", "weight_shape", "weight_zero_point"),
            decode_nvfp4,
            "NVFP4: FP4 E2M1 two per byte, one e4m3 scale per 16 values, fp32 global scale",
            shape_part="weight_packed",
            default_block=(1, NV_GROUP),
            group=NV_GROUP,
            packing="fp4",
            ct_formats=(NVFP4,),
            detect_dtypes=("weight_packed",),
            storage_label="nvfp4",
            weight_args=_NV_ARGS,
            direct_dtypes=(torch.float32, torch.bfloat16),
        ),
    )
}

#: the encoded formats (everything but ``plain``), as older code names them
ENCODINGS: dict[str, Encoding] = {k: v for k, v in FORMATS.items() if k != PLAIN}


def detect_encoding(logical: str, parts: PartSig) -> Encoding | None:
    """The encoding of a group of parts; None for a plain tensor. Errors if ambiguous."""
    if set(parts) <= {"weight", *ACTIVATION_PARTS} and "weight" in parts:
        return None
    key = tuple(sorted((k, v[1]) for k, v in parts.items()))  # what matches() reads
    hit = _DETECTED.get(key)
    if hit is not None:
        return ENCODINGS[hit]
    hits = [e for e in ENCODINGS.values() if e.matches(parts)]
    if len(hits) != 1:
        known = ", ".join(f"{e.name}: {'+'.join(e.required)}" for e in ENCODINGS.values())
        raise CheckpointError(
            f"tensor '{logical}': parts {sorted(parts)} match "
            f"{'several' if hits else 'no'} known encodings ({known})."
        )
    _DETECTED[key] = hits[0].name
    return hits[0]


#: part names and dtypes -> the name of the one encoding they match (a model has a few
#: signatures and hundreds of thousands of tensors)
_DETECTED: dict[tuple, str] = {}


def encoding_for_ct_format(fmt: str | None) -> Encoding | None:
    """The encoding that stores compressed-tensors format ``fmt`` (None if none does)."""
    for e in ENCODINGS.values():
        if fmt in e.ct_formats:
            return e
    return None


def ct_format(weight_type: str, num_bits: int, group_size: int | None, activations: bool) -> str:
    """The compressed-tensors ``format`` its compressor infers for a weight scheme (the
    priority order of ``compressed_tensors.compressors.format``): FP4 with groups of 32
    is mxfp4-pack-quantized, FP4 with groups of 16 nvfp4-pack-quantized, int weights with
    quantized activations int-quantized and weight-only int pack-quantized, FP8 weights
    float-quantized (naive-quantized when weight-only: compressed-tensors' own choice,
    whose dequantizer re-infers it and ignores what config.json says)."""
    if weight_type == "float" and num_bits == 4:
        if group_size == MX_GROUP:
            return MXFP4
        if group_size == NV_GROUP:
            return NVFP4
        raise ValueError(f"FP4 weights need groups of {MX_GROUP} or {NV_GROUP}")
    if weight_type == "int":
        return "int-quantized" if activations else "pack-quantized"
    return "float-quantized" if activations else "naive-quantized"
