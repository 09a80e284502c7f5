"""Storage formats of a logical weight: the one registry every stage reads, and the codecs.

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

The package's modules, each importing only those above it in this list: :mod:`.base`
(part names, constants, :class:`QuantParams`), :mod:`.dtypes` (dtype names),
:mod:`.intn` (int-N words), :mod:`.fp4` (E2M1 codes, the FP4 references and the table
decode with the native kernels' wrappers), :mod:`.registry` (the encodings); this
package imports nothing of k3convert but the errors and the native kernels (every other
layer imports it).
"""

from . import fp4, intn
from .base import (
    ACTIVATION,
    ACTIVATION_PARTS,
    ALL_PARTS,
    E8M0_BIAS,
    FP4_MAX,
    FP8_DTYPES,
    FP8_MAX,
    G_IDX,
    GLOBAL_SCALE,
    INPUT_GLOBAL_SCALE,
    INPUT_SCALE,
    INPUT_ZERO_POINT,
    MX_GROUP,
    NV_GROUP,
    PART_ROLES,
    SCALE,
    SHAPE,
    VALUES,
    WEIGHT_PARTS,
    ZERO_POINT,
    PartSig,
    QuantParams,
)
from .fp4 import e8m0_to_float, mxfp4_reference, nvfp4_reference
from .registry import (
    COPY,
    ENCODINGS,
    FORMATS,
    LOCAL_SHAPE,
    MXFP4,
    NVFP4,
    PLAIN,
    AxisMap,
    Dequantizer,
    Encoding,
    PartSpec,
    UnsplittableError,
    ct_format,
    detect_encoding,
    encoding_for_ct_format,
    expand_scale,
    infer_num_bits,
    scale_block,
)

__all__ = [
    "ACTIVATION",
    "ACTIVATION_PARTS",
    "ALL_PARTS",
    "COPY",
    "E8M0_BIAS",
    "ENCODINGS",
    "FORMATS",
    "FP4_MAX",
    "FP8_DTYPES",
    "FP8_MAX",
    "GLOBAL_SCALE",
    "G_IDX",
    "INPUT_GLOBAL_SCALE",
    "INPUT_SCALE",
    "INPUT_ZERO_POINT",
    "LOCAL_SHAPE",
    "MXFP4",
    "MX_GROUP",
    "NVFP4",
    "NV_GROUP",
    "PART_ROLES",
    "PLAIN",
    "SCALE",
    "SHAPE",
    "VALUES",
    "WEIGHT_PARTS",
    "ZERO_POINT",
    "AxisMap",
    "Dequantizer",
    "Encoding",
    "PartSig",
    "PartSpec",
    "QuantParams",
    "UnsplittableError",
    "ct_format",
    "detect_encoding",
    "e8m0_to_float",
    "encoding_for_ct_format",
    "expand_scale",
    "fp4",
    "infer_num_bits",
    "intn",
    "mxfp4_reference",
    "nvfp4_reference",
    "scale_block",
]
