"""Storage formats of a logical weight: the one registry every stage reads.

A released or quantized checkpoint stores some weights as several physical tensors
(*parts*) under one logical name ``...weight``. Everything k3convert knows about such a
layout lives here, one :class:`Encoding` per format, in :data:`FORMATS`:

- its name (the compressed-tensors ``format`` string where one exists) and the
  compressed-tensors formats it covers (:attr:`Encoding.ct_formats`);
- its parts and their roles (values, scale, zero point, global scale, shape), the
  dtypes they may have, which are required and which forbidden - the detector
  (:func:`detect_encoding`) matches stored parts against exactly these;
- where the logical shape comes from, the geometry the parts must have
  (:meth:`Encoding.problem`) and how config.json's quantization_config resolves for it
  (:meth:`Encoding.resolve_quant`);
- its dequantizer (bit for bit what compressed-tensors' decompressor computes);
- how every part follows a split of each logical dim (:meth:`Encoding.axis_maps`: the
  granule is an FP8 block, an int group, a packed int32 word of ``32 / bits`` values,
  or an FP4 byte of 2 values inside a group of 32 / 16);
- for the fixed formats (MXFP4 / NVFP4), the quantization_config weights they imply
  (:attr:`Encoding.weight_args`).

=========================  ===================================================  ==============
encoding                   parts (logical weight [out, in])                     source
=========================  ===================================================  ==============
``plain``                  ``weight`` any dtype                                 every release
``fp8-block``              ``weight`` fp8 + ``weight_scale_inv`` [ceil(out/128),  DeepSeek-V3,
                           ceil(in/128)] (fp32 or ue8m0)                        Kimi-K2
``pack-quantized``         ``weight_packed`` int32 [out, ceil(in*b/32)] +       compressed-
                           ``weight_scale`` + ``weight_shape`` [2] (+ zero      tensors int-N
                           point int32 [ceil(out*b/32), groups])
``float-quantized``        ``weight`` fp8 + ``weight_scale`` (tensor / channel   compressed-
                           / group / block)                                     tensors FP8
``int-quantized``          ``weight`` int8 + ``weight_scale`` (+ zero point)    compressed-
                                                                                tensors INT8
``mxfp4-pack-quantized``   ``weight_packed`` uint8 [out, in/2] (FP4 E2M1, low   Kimi K3
                           nibble = even column) + ``weight_scale`` uint8       experts
                           [out, in/32] (E8M0 exponents, bias 127)
``nvfp4-pack-quantized``   ``weight_packed`` uint8 [out, in/2] + ``weight_scale``  compressed-
                           fp8 e4m3 [out, in/16] + ``weight_global_scale``      tensors NVFP4
                           fp32 [1]
=========================  ===================================================  ==============

Activation parameters (``input_scale``, ``input_global_scale`` ...) ride along as parts
of every encoding (plain included); they do not change the weight and are copied whole
by a split.

FP4 arithmetic (compressed-tensors 0.20: ``nvfp4/helpers.py``, ``mx_utils.py``,
``lifecycle/forward.py``): an MXFP4 value is ``e2m1 * 2**(e - 127)``; an NVFP4 value is
``e2m1 * (scale / global_scale)`` computed in float32. Both are returned in float32;
compressed-tensors' decompressors hand out the same numbers rounded to bfloat16 (MXFP4
products are exact in bfloat16, so only NVFP4 differs, by that final rounding).

The codecs themselves (int-N words, FP4 nibbles, E2M1 rounding) are in
:mod:`k3convert.quant.packing`; they are imported when first used, so that this module
imports nothing of k3convert but the errors (every other layer imports it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError

# -- part names and roles -------------------------------------------------------------
VALUES = "values"
SCALE = "scale"
ZERO_POINT = "zero_point"
GLOBAL_SCALE = "global_scale"
SHAPE = "shape"
G_IDX = "g_idx"
ACTIVATION = "activation"

#: the role of every part suffix k3convert knows
PART_ROLES: dict[str, str] = {
    "weight": VALUES,
    "weight_scale_inv": SCALE,
    "weight_packed": VALUES,
    "weight_scale": SCALE,
    "weight_shape": SHAPE,
    "weight_zero_point": ZERO_POINT,
    "weight_g_idx": G_IDX,
    "weight_global_scale": GLOBAL_SCALE,
    "input_scale": ACTIVATION,
    "input_zero_point": ACTIVATION,
    "input_global_scale": ACTIVATION,
    "output_scale": ACTIVATION,
}
#: suffixes that attach to a weight instead of being tensors of their own
ACTIVATION_PARTS = tuple(p for p, r in PART_ROLES.items() if r == ACTIVATION)
WEIGHT_PARTS = tuple(p for p, r in PART_ROLES.items() if r != ACTIVATION)
ALL_PARTS = WEIGHT_PARTS + ACTIVATION_PARTS

#: activation parameters, by what they hold: a static per-tensor scale (and zero point)
#: of a calibrated FP8 / INT8 input, the global scale of an NVFP4 input
INPUT_SCALE = "input_scale"
INPUT_ZERO_POINT = "input_zero_point"
INPUT_GLOBAL_SCALE = "input_global_scale"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
FP4_MAX = 6.0  # largest E2M1 magnitude
MX_GROUP = 32  # OCP MX: one E8M0 exponent per 32 values
NV_GROUP = 16  # NVFP4: one e4m3 scale per 16 values
E8M0_BIAS = 127

PartSig = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # part -> (shape, dtype)


@dataclass(frozen=True)
class QuantParams:
    """What config.json says about a weight's quantization (may be partly unknown)."""

    num_bits: int | None = None
    block: tuple[int, int] | None = None  # (rows, cols) covered by one scale
    symmetric: bool | None = None
    extra: dict = field(default_factory=dict)


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
        return AxisMap(0, b[0], packed_bits, f"{what} (zero points packed {packed_bits}-bit)")
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
    from .quant.packing import unpack_int32

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


def _fp4_groups(
    p: Mapping[str, torch.Tensor], group: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, int, int]:
    """E2M1 values of ``weight_packed`` as ``dtype`` [out, in / group, group]."""
    from .quant.packing import unpack_fp4

    out, inp = _check_fp4_groups(p, group)
    return unpack_fp4(p["weight_packed"], dtype).view(out, inp // group, group), out, inp


def _check_fp4_groups(p: Mapping[str, torch.Tensor], group: int) -> tuple[int, int]:
    """(out, in) of an FP4 weight whose ``weight_scale`` holds one scale per ``group``."""
    packed, scale = p["weight_packed"], p["weight_scale"]
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(
            f"FP4 data must be uint8 [rows, cols], got {packed.dtype}{list(packed.shape)}"
        )
    out, cols = packed.shape
    inp = 2 * cols
    if inp % group or tuple(scale.shape) != (out, inp // group):
        raise ValueError(
            f"weight_scale {list(scale.shape)} does not hold one scale per {group} values "
            f"of the {out} x {inp} weight (expected {[out, inp // group]})"
        )
    return out, inp


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8, bias 127) -> their float32 powers of two, exactly.

    0 is 2**-127 (a float32 subnormal), 255 is +inf (as compressed-tensors decodes it).
    """
    e32 = e.to(torch.int32)
    bits = torch.where(e32 == 0, torch.tensor(1 << 22, dtype=torch.int32), e32 << 23)
    return bits.view(torch.float32)


def mxfp4_reference(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E2M1 x 2**(e - 127): a value of at most 2 significant bits times a power of two,
    exact in float32 and in bfloat16 (same exponent range), so either is computed
    directly. The reference the lookup table of :func:`_deq_mxfp4` is built from."""
    vals, out, inp = _fp4_groups(p, MX_GROUP, dtype)
    scale = e8m0_to_float(p["weight_scale"]).to(dtype)
    return vals.mul_(scale.unsqueeze(-1)).view(out, inp)


def nvfp4_reference(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E2M1 x (scale / global_scale) in float32 (as compressed-tensors computes it),
    rounded to ``dtype`` last. The reference the tables of :func:`_deq_nvfp4` are built
    from."""
    vals, out, inp = _fp4_groups(p, NV_GROUP)
    g = p["weight_global_scale"].to(torch.float32).reshape(1, 1)
    eff = p["weight_scale"].to(torch.float32) / g  # compressed-tensors: scale / global
    return vals.mul_(eff.unsqueeze(-1)).view(out, inp).to(dtype)


def _all_pairs(scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parts of a [256, 512] FP4 weight whose row s holds every byte under scale code s
    (one scale per 16 bytes: each byte appears in its own group when viewed [256, 256, 2])."""
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).repeat(256, 1)
    per = 32 if scale_dtype == torch.uint8 else 16  # values per scale
    codes = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, 512 * 16 // per)
    return {"weight_packed": packed, "weight_scale": codes.contiguous().view(scale_dtype)}


def _pair_values(vals: torch.Tensor) -> torch.Tensor:
    """[256, 256 * 16 * 2] reference output of :func:`_all_pairs` -> [256, 256, 2]."""
    return vals.view(256, 256, 16, 2)[:, :, 0, :].contiguous()


@functools.cache
def _mx_values(dtype: torch.dtype) -> torch.Tensor:
    """[256 E8M0 codes, 16 nibbles] ``dtype``: :func:`mxfp4_reference`'s own output for
    each nibble under each code (one MX group per code, byte k holding nibble k low and 0
    high), computed once per dtype."""
    with torch.inference_mode(False):  # plain tensors, whichever mode the first caller runs in
        packed = torch.arange(16, dtype=torch.uint8).repeat(256, 1)
        codes = torch.arange(256, dtype=torch.uint8).unsqueeze(1)
        ref = mxfp4_reference({"weight_packed": packed, "weight_scale": codes}, QuantParams(),
                              dtype)  # fmt: skip
        return ref[:, 0::2].contiguous()


@functools.cache
def _mx_kernel(dtype: torch.dtype) -> torch.Tensor:
    """The decode kernel's table of :func:`_mx_values`, once per dtype."""
    from . import native

    with torch.inference_mode(False):
        return native.decode_table(_mx_values(dtype), dtype)


@functools.cache
def _mx_pair_table(dtype: torch.dtype) -> torch.Tensor:
    """The MXFP4 pair table of the torch path (without the kernels): the reference on
    every (E8M0 code, byte) pair, once per dtype."""
    from .quant import fp4_decode

    with torch.inference_mode(False):
        ref = mxfp4_reference(_all_pairs(torch.uint8), QuantParams(), dtype)
        return fp4_decode.pair_table(_pair_values(ref), dtype)


def _deq_mxfp4(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`mxfp4_reference` bit for bit: the nibble-table kernel of
    :mod:`k3convert.native` (every output a copy of :func:`_mx_values`' entry for its
    code and nibble) where it is available, else one (E8M0 code, byte) pair-table gather
    (:mod:`k3convert.quant.fp4_decode`)."""
    from . import native
    from .quant import fp4_decode

    if not fp4_decode.LITTLE_ENDIAN or dtype not in fp4_decode.PAIR_WORD:
        return mxfp4_reference(p, q, dtype)
    _check_fp4_groups(p, MX_GROUP)
    packed, codes = p["weight_packed"].contiguous(), p["weight_scale"].contiguous()
    if packed.numel() and native.ENABLED and native.library() is not None:
        vals = _mx_values(dtype)
        got = native.fp4_decode(packed, codes, vals, dtype, MX_GROUP, table=_mx_kernel(dtype))
        if got is not None:
            return got
    return fp4_decode.decode(packed, codes, MX_GROUP, _mx_pair_table(dtype), dtype)


def _deq_nvfp4(
    p: Mapping[str, torch.Tensor], q: QuantParams, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`nvfp4_reference` bit for bit: the reference's own float32 ops (scale / global,
    times E2M1, rounded to ``dtype``) on every (e4m3 code, nibble) pair of this tensor's
    global scale, then each value a copy of its pair's: the nibble-table kernel of
    :mod:`k3convert.native` (4096 values per tensor), else a (code, byte) pair-table gather
    (65536 pairs, small next to an expert)."""
    from .quant import fp4_decode

    if not fp4_decode.LITTLE_ENDIAN or dtype not in fp4_decode.PAIR_WORD:
        return nvfp4_reference(p, q, dtype)
    _check_fp4_groups(p, NV_GROUP)
    from . import native

    g = p["weight_global_scale"].to(torch.float32).reshape(1, 1)
    packed, stored = p["weight_packed"].contiguous(), p["weight_scale"].contiguous()
    codes = stored.view(torch.uint8)
    if packed.numel() and native.ENABLED and native.library() is not None:
        vals, table = _nv_kernel(int(g.reshape(()).view(torch.int32)), dtype)
        got = native.fp4_decode(packed, codes, vals, dtype, NV_GROUP, table=table)
        if got is not None:
            return got
    return fp4_decode.decode(packed, codes, NV_GROUP, _nv_table(g, dtype), dtype)


#: float32 [256, 1, 1]: the value of each e4m3 byte
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_E4M3 = _E4M3.reshape(256, 1, 1)


def _nv_eff(g: torch.Tensor) -> torch.Tensor:
    """float32 [256, 1, 1]: the reference's effective scale (scale / global) of each e4m3
    scale byte under global scale ``g``."""
    return _E4M3 / g


def _nv_values(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[256 e4m3 codes, 16 nibbles] ``dtype``: the reference's value of each nibble under
    each scale byte (the pair table's entries for the bytes 0..15, low nibble)."""
    from .quant.packing import _BYTE_LUT

    vals = torch.empty(256, 16, dtype=dtype)
    torch.mul(_BYTE_LUT[:16, 0].reshape(1, 16), _nv_eff(g).view(256, 1), out=vals)
    return vals


@functools.lru_cache(maxsize=64)
def _nv_kernel(bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_nv_values` and the decode kernel's table of them, per (global scale bits,
    dtype): a checkpoint's experts share a few global scales, so each is built once."""
    from . import native

    with torch.inference_mode(False):  # plain tensors, whichever mode the first caller runs in
        g = torch.tensor([bits], dtype=torch.int32).view(torch.float32).reshape(1, 1)
        vals = _nv_values(g, dtype)
        return vals, native.decode_table(vals, dtype)


def _nv_table(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (e4m3 code, byte) pair table under global scale ``g``: the reference's own ops."""
    from .quant import fp4_decode
    from .quant.packing import _BYTE_LUT

    eff = _nv_eff(g)  # the reference's eff, per code
    vals = torch.empty(256, 256, 2, dtype=dtype)
    for c in range(0, 256, 32):  # 16384 products per op: each runs on this thread
        torch.mul(_BYTE_LUT.view(1, 256, 2), eff[c : c + 32], out=vals[c : c + 32])
    return fp4_decode.pair_table(vals, dtype)


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
            _deq_mxfp4,
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
            _deq_nvfp4,
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
    hits = [e for e in ENCODINGS.values() if e.matches(parts)]
    if len(hits) != 1:
        known = ", ".join(f"{e.name}: {'+'.join(e.required)}" for e in ENCODINGS.values())
        raise CheckpointError(
            f"tensor '{logical}': parts {sorted(parts)} match "
            f"{'several' if hits else 'no'} known encodings ({known})."
        )
    return hits[0]


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


__all__ = [
    "ACTIVATION_PARTS",
    "ALL_PARTS",
    "COPY",
    "ENCODINGS",
    "FORMATS",
    "FP8_DTYPES",
    "LOCAL_SHAPE",
    "MXFP4",
    "NVFP4",
    "PART_ROLES",
    "PLAIN",
    "WEIGHT_PARTS",
    "AxisMap",
    "Encoding",
    "PartSpec",
    "QuantParams",
    "ct_format",
    "detect_encoding",
    "e8m0_to_float",
    "encoding_for_ct_format",
    "expand_scale",
    "infer_num_bits",
    "scale_block",
]
