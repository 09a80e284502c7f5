"""MXFP4 / NVFP4 read, write and split, against compressed-tensors 0.20 and transformers.

Oracles (code we did not write):

- the scale choice: compressed-tensors' ``calculate_qparams`` (and ``generate_gparam``
  for NVFP4's global scale) over per-group min / max taken as llm-compressor's weight
  observer takes them, for the preset schemes MXFP4A16 / NVFP4A16 / NVFP4; the bytes:
  ``MXFP4PackedCompressor`` / ``NVFP4PackedCompressor.compress`` from those scales;
- dequantization: the same classes' ``decompress`` (their bfloat16 output) and, for
  NVFP4 in float32, compressed-tensors' ``dequantize`` on float32 E2M1 values;
- NVFP4 activations: compressed-tensors' ``forward_quantize`` on a module holding an
  ``input_global_scale``;
- transformers 5.24 loading our output with ``CompressedTensorsConfig(dequantize=True)``.
  Loading it compressed (the default) fails on CPU in float32: compressed-tensors
  decompresses FP4 weights to bfloat16 and ``F.linear`` refuses float32 inputs against
  bfloat16 weights ("expected m1 and m2 to have the same dtype"), so that path is tested
  in bfloat16 only.
"""

from __future__ import annotations

import contextlib
import io
import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3convert import formats, native
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import CheckpointError
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.quant import ActivationSpec, fake_quant_activation, get_scheme
from k3convert.quant.schemes import GroupSizeError, WeightRangeError, quantize_mxfp4
from k3convert.quant.writer import fused_groups
from k3convert.shard import SplitError, legal_degrees, split_tensor
from k3convert.stream import read_manifest_doc
from tests.models import save_model

PRESET = {"mxfp4": "MXFP4A16", "nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}


# -- compressed-tensors' own path -------------------------------------------------------
def _ct_scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def _compressor(preset: str):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return MXFP4PackedCompressor if preset.startswith("MX") else NVFP4PackedCompressor


def ct_compress(w: torch.Tensor, preset: str, fused: list[torch.Tensor] | None = None):
    """What llm-compressor's weight observer + compressed-tensors write for ``w``: per
    group min / max (the observer's amin / amax over (0, -1) of [1, rows, groups, g]),
    calculate_qparams, the scale kept in the weight's dtype (the module parameter), then
    the compressor. fused: the tensors sharing the global scale (w among them)."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = _ct_scheme(preset)
    args = scheme.weights
    obs = w.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    mn, mx = torch.amin(obs, dim=(0, -1)), torch.amax(obs, dim=(0, -1))
    gs = None
    if preset.startswith("NV"):
        top = torch.max(mx.max(), -mn.min())
        for f in fused or []:
            top = torch.max(top, f.abs().max())
        gs = generate_gparam(-top.reshape(1), top.reshape(1))
    scale, _ = calculate_qparams(mn, mx, args, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype)}
    if gs is not None:
        sd["weight_global_scale"] = gs
    return dict(_compressor(preset).compress(sd, scheme))


def ct_decompress(parts: dict, preset: str) -> torch.Tensor:
    return _compressor(preset).decompress(dict(parts), _ct_scheme(preset))["weight"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bytes(a[k]),
                                                                              _bytes(b[k]))
        for k in a
    )  # fmt: skip


def _weight(kind: str, dtype: torch.dtype, shape=(48, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    out, inp = shape
    if kind == "normal":
        w = torch.randn(shape, generator=g) * 0.02
    elif kind == "student_t":  # heavy tails: a few huge values per row
        w = torch.distributions.StudentT(2.0).sample(shape)
    elif kind == "zero_rows":
        w = torch.randn(shape, generator=g)
        w[3] = 0
        w[7, :64] = 0
        w[9, 32:48] = -0.0
    elif kind == "subnormal":  # groups of bf16 / fp32 subnormals, next to large values
        w = torch.randn(shape, generator=g) * 1e-39
        w[0, 0] = 16.0
        w[1, :32] = -1e-40
        w[1, 1] = 16.0
        w[2, :16] = 2.0**-130
        w[4] = torch.randn(inp, generator=g) * 1e-30
    elif kind == "equal":  # every group one repeated value, incl. FP4 ties after scaling
        vals = torch.tensor([0.3, -5.0, 1.75, 0.125, 3.0, -2.5, 7.0, 1e-3])
        w = vals.repeat_interleave(32).repeat(out, inp // 256)
    else:
        raise AssertionError(kind)
    return w.to(dtype)


KINDS = ["normal", "student_t", "zero_rows", "subnormal", "equal"]


# -- write: bytes equal compressed-tensors' ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4a16"])
def test_quantize_bytes_equal_compressed_tensors(scheme, kind, dtype):
    w = _weight(kind, dtype)
    ours = get_scheme(scheme).quantize(w, name="t.weight")
    theirs = ct_compress(w.clone(), PRESET[scheme])
    assert _same(ours, theirs), {k: int((_bytes(ours[k]) != _bytes(theirs[k])).sum()) for k in ours}
    if scheme == "mxfp4":
        assert _same(quantize_mxfp4(w), theirs)


def test_fused_global_scale_equals_llm_compressor_fusion():
    """gate/up share one global scale from the larger absmax (FusionHandler)."""
    gate, up = _weight("normal", torch.bfloat16), _weight("student_t", torch.bfloat16)
    top = torch.maximum(gate.abs().max(), up.abs().max()).float()
    s = get_scheme("nvfp4a16")
    for w in (gate, up):
        ours = s.quantize(w, global_amax=top)
        assert _same(ours, ct_compress(w, "NVFP4A16", fused=[gate, up]))
    assert (
        s.quantize(gate)["weight_global_scale"]
        != s.quantize(gate, global_amax=top)["weight_global_scale"]
    )


def test_quantize_refuses_what_it_cannot_store():
    with pytest.raises(GroupSizeError, match=r"t\.weight"):
        get_scheme("mxfp4").quantize(torch.randn(4, 48), name="t.weight")
    with pytest.raises(GroupSizeError, match="16"):
        get_scheme("nvfp4").check("t.weight", (4, 40))
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        get_scheme("nvfp4a16").quantize(w, name="t.weight")
    w = torch.ones(4, 64)
    w[0, 0] = 3.0e38  # E8M0 would need 2**126+ -> stored as infinity
    with pytest.raises(WeightRangeError, match=r"t\.weight"):
        get_scheme("mxfp4").quantize(w, name="t.weight")


def _huge(dtype, mag: float) -> torch.Tensor:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    w[0, 0], w[0, 1] = mag, -mag
    w[5, 200] = -mag
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_weights_are_stored_finite_or_refused(dtype):
    """Never a checkpoint that dequantizes to infinity: MXFP4's largest finite value is
    1.5 x 2**127 (E8M0 254 x E2M1 1.5: the group maximum 2.5e38 still has a scale
    whose products stay finite), beyond that the tensor is refused by name; NVFP4
    divides by the global scale and holds 3e38, but not the float maximum."""
    for scheme, mag, ok in [("mxfp4", 2.5e38, True), ("mxfp4", 3e38, False),
                            ("nvfp4a16", 3e38, True), ("nvfp4a16", float(torch.finfo(dtype).max),
                                                      False)]:  # fmt: skip
        s, w = get_scheme(scheme), _huge(dtype, mag)
        if not ok:
            with pytest.raises(WeightRangeError, match=r"'m\.x\.weight'.*--keep"):
                s.quantize(w, name="m.x.weight")
            continue
        parts = s.quantize(w, name="m.x.weight")
        assert _same(parts, ct_compress(w, PRESET[scheme]))  # still compressed-tensors' bytes
        d = s.dequantize(parts)
        assert torch.isfinite(d).all()
        assert float((d - w.float()).abs().max()) <= 0.25 * mag


# -- read: dequantize equals compressed-tensors' decompressor ----------------------------
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4a16"])
def test_dequantize_equals_decompress(scheme):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    g = torch.Generator().manual_seed(1)
    out, inp = 40, 128
    grp = 32 if scheme == "mxfp4" else 16
    # every byte value, and scales across their range (not only what a quantizer makes)
    packed = torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8)
    packed[0, :] = torch.arange(64, dtype=torch.uint8) * 4 + torch.arange(4).repeat(16)
    if scheme == "mxfp4":
        parts = {
            "weight_packed": packed,
            "weight_scale": torch.randint(1, 250, (out, inp // grp), generator=g).to(torch.uint8),
        }
        parts["weight_scale"][0, 0] = 0  # 2**-127
    else:
        sc = torch.rand(out, inp // grp, generator=g) * 400 + 2.0**-9
        parts = {
            "weight_packed": packed,
            "weight_scale": sc.to(torch.float8_e4m3fn),
            "weight_global_scale": torch.tensor([2688.0 / 3.7]),
        }
    ours = formats.FORMATS[formats.MXFP4 if scheme == "mxfp4" else formats.NVFP4].dequantize(
        parts, formats.QuantParams()
    )
    theirs = ct_decompress(parts, PRESET[scheme])
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    assert torch.equal(_bytes(ours.to(torch.bfloat16)), _bytes(theirs))
    enc = formats.ENCODINGS[formats.MXFP4 if scheme == "mxfp4" else formats.NVFP4]
    direct = enc.dequantize_to(parts, formats.QuantParams(), torch.bfloat16)  # MX: in bf16
    assert torch.equal(_bytes(direct), _bytes(theirs))
    if scheme == "mxfp4":  # exact products: the float32 values are compressed-tensors'
        assert torch.equal(ours, theirs.float())
    else:  # float32: compressed-tensors' dequantize on float32 E2M1 values
        q = unpack_fp4_from_uint8(packed, out, inp, dtype=torch.float32)
        args = _ct_scheme("NVFP4A16").weights
        d = dequantize(x_q=q, scale=parts["weight_scale"].float(), args=args,
                       global_scale=parts["weight_global_scale"], dtype=torch.float32)  # fmt: skip
        assert torch.equal(_bytes(ours), _bytes(d))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4a16"])
@pytest.mark.parametrize("chunk", [None, 3000])
def test_table_decode_is_the_reference_bit_for_bit(scheme, dtype, chunk, monkeypatch):
    """The (scale code, byte) table decode against the elementwise reference it replaced:
    every byte under every scale code (E8M0 0 / 1 / 254 / 255, e4m3 NaN and subnormal
    codes included), then random tensors spanning several row chunks, odd row counts and
    a one-group-per-row width; NVFP4 also at global scales that overflow / underflow."""
    from k3convert.formats import fp4 as fp4_decode

    if chunk:  # many chunks and a partial last one, whichever thread count runs the test
        monkeypatch.setattr(fp4_decode, "_CHUNK_BYTES", chunk)
        monkeypatch.setattr(fp4_decode, "_CHUNK_BYTES_1T", chunk)
    mx = scheme == "mxfp4"
    grp = formats.MX_GROUP if mx else formats.NV_GROUP
    ref = formats.mxfp4_reference if mx else formats.nvfp4_reference
    fast = formats.FORMATS[formats.MXFP4 if mx else formats.NVFP4]
    g = torch.Generator().manual_seed(3)
    every = torch.arange(256, dtype=torch.uint8).repeat_interleave(grp // 2)
    cases = [(every.repeat(256, 1), torch.arange(256, dtype=torch.uint8).unsqueeze(1)
              .expand(256, 256).contiguous())]  # fmt: skip
    for out, inp in ((3, grp), (97, 1536), (fp4_decode._CHUNK_BYTES // 100 + 7, 200 * grp)):
        cases.append((
            torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8),
            torch.randint(0, 256, (out, inp // grp), generator=g, dtype=torch.uint8),
        ))  # fmt: skip
    gscales = [1.0] if mx else [2688.0 / 3.7, 1e-30, 3e35, 0.0]
    checked = 0
    for packed, codes in cases:
        for gs in gscales:
            parts = {"weight_packed": packed, "weight_scale": codes}
            if not mx:
                parts["weight_scale"] = codes.view(torch.float8_e4m3fn)
                parts["weight_global_scale"] = torch.tensor([gs])
            got = fast.dequantize_to(parts, formats.QuantParams(), dtype)
            want = ref(parts, formats.QuantParams(), dtype)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape
            assert torch.equal(_bits(got), _bits(want)), (scheme, dtype, packed.shape, gs)
            checked += got.numel()
    assert checked >= 256 * 256 * grp  # the all-pairs case ran


def test_table_decode_refuses_bad_geometry():
    parts = {"weight_packed": torch.zeros(4, 16, dtype=torch.uint8),
             "weight_scale": torch.zeros(4, 2, dtype=torch.uint8)}  # fmt: skip
    with pytest.raises(ValueError, match="one scale per 32 values"):
        formats.FORMATS[formats.MXFP4].dequantize_to(parts, formats.QuantParams())
    parts["weight_packed"] = torch.zeros(4, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="FP4 data must be uint8"):
        formats.FORMATS[formats.MXFP4].dequantize_to(parts, formats.QuantParams())


# -- the reader: detection from what is stored ---------------------------------------------
def _k3_like(tmp_path: Path, scale_cols: int | None = None, nv: bool = False):
    """A one-layer checkpoint laid out like the K3 release: experts mxfp4 (or nvfp4),
    the quantization_config inside text_config, one bf16 Linear its ignore list misses."""
    d = tmp_path / "k3"
    d.mkdir()
    g = torch.Generator().manual_seed(2)
    sd, ref = {}, {}
    preset = "NVFP4A16" if nv else "MXFP4A16"
    for e in range(2):
        w = (torch.randn(64, 128, generator=g) * 0.05).bfloat16()
        base = f"language_model.model.layers.0.block_sparse_moe.experts.{e}.w1"
        parts = ct_compress(w, preset)
        ref[f"{base}.weight"] = ct_decompress(parts, preset)
        if scale_cols is not None and e == 1:
            parts["weight_scale"] = torch.zeros(64, scale_cols, dtype=torch.uint8)
        sd.update({f"{base}.{k}": v for k, v in parts.items()})
    sd["language_model.model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 64).bfloat16()
    save_file(sd, d / "model.safetensors")
    qc = {
        "quant_method": "compressed-tensors",
        "format": formats.NVFP4 if nv else formats.MXFP4,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": _ct_scheme(preset).weights.model_dump(mode="json"),
            "format": formats.NVFP4 if nv else formats.MXFP4,
        }},
        "ignore": ["language_model.lm_head"],
    }  # fmt: skip
    cfg = {"model_type": "kimi_k3", "text_config": {"quantization_config": qc}}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, ref


@pytest.mark.parametrize("nv", [False, True], ids=["mxfp4", "nvfp4"])
def test_reader_detects_from_storage(tmp_path, nv):
    d, ref = _k3_like(tmp_path, nv=nv)
    ck = open_checkpoint(d)
    enc = formats.NVFP4 if nv else formats.MXFP4
    for name, want in ref.items():
        m = ck.meta(name)
        assert (m.encoding, m.shape, m.storage) == (enc, (64, 128), "nvfp4" if nv else "mxfp4")
        assert m.quant.block == ((1, 16) if nv else (1, 32)) and m.quant.num_bits == 4
        assert torch.equal(_bytes(ck.get(name, torch.bfloat16)), _bytes(want))
    plain = "language_model.model.layers.0.self_attn.o_proj.weight"
    assert ck.meta(plain).encoding == "plain"  # claimed quantized (targets Linear), stored bf16
    assert ck.claimed_plain == [(plain, enc)]


def test_reader_wrong_mxfp4_scale_shape(tmp_path):
    d, _ = _k3_like(tmp_path, scale_cols=8)  # [out, in/16] for in=128: MXFP4 wants in/32
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(d)
    msg = str(ei.value)
    name = "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_scale"
    assert name in msg and "[64, 8]" in msg and "uint8[64, 4]" in msg, msg
    assert "\n" not in msg


def test_reader_fp8_scales_without_global_scale_is_no_format(tmp_path):
    d, _ = _k3_like(tmp_path, nv=True)
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    del sd["language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight_global_scale"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight'.*no known encodings"):
        open_checkpoint(d)


# -- activations: NVFP4 inputs as compressed-tensors' forward ---------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 128)])
@pytest.mark.parametrize("gscale", [None, 23.5])
def test_nvfp4_activations_match_forward_quantize(shape, dtype, gscale):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    spec = get_scheme("nvfp4").act
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    x.view(-1, shape[-1])[0, 3] = 40.0
    x.view(-1, shape[-1])[1, :16] = 0  # an all-zero group: scale 0 -> 0.125
    x.view(-1, shape[-1])[1, 16:32] = -1e-4
    if gscale is not None:
        spec = spec.with_global_scale(gscale)
    m = torch.nn.Module()
    m.quantization_status = QuantizationStatus.FROZEN
    m.input_global_scale = torch.tensor([1.0 if gscale is None else gscale])
    args = QuantizationArgs.model_validate(spec.ct_args())
    assert args.model_dump(mode="json") == _ct_scheme("NVFP4").input_activations.model_dump(
        mode="json"
    )
    theirs = forward_quantize(m, x, "input", args)
    ours = fake_quant_activation(x, spec)
    assert ours.dtype == theirs.dtype and torch.equal(_bytes(ours), _bytes(theirs))
    assert ActivationSpec.from_ct_args(spec.ct_args()) == spec


# -- the writer end to end: config, bytes, compressed-tensors, transformers ----------------
@pytest.fixture(scope="module")
def moe_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fp4_src")
    return save_model("qwen3_moe", d / "m", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp4_out(moe_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp4_out")
    cache = {}

    def get(scheme: str) -> Path:
        if scheme not in cache:
            cache[scheme] = root / scheme
            quantize(src=moe_src, out=cache[scheme], scheme=scheme, progress=False, workers=2)
        return cache[scheme]

    return get


def _load(path, dtype=torch.float32, **kw):
    import transformers as tf

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


def _logits(path, ids, dtype=torch.float32, **kw):
    with torch.no_grad():
        return _load(path, dtype, **kw)(ids).logits


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4a16", "nvfp4"])
def test_quantize_output_against_compressed_tensors_and_transformers(
    scheme, moe_src, fp4_out, tmp_path
):
    out = fp4_out(scheme)
    ck, src = open_checkpoint(out), open_checkpoint(moe_src)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    preset = _ct_scheme(PRESET[scheme])
    enc = formats.MXFP4 if scheme == "mxfp4" else formats.NVFP4
    assert qc["format"] == enc and qc["config_groups"]["group_0"]["format"] == enc
    want = preset.weights.model_dump(mode="json")
    got = qc["config_groups"]["group_0"]["weights"]
    assert {k: got[k] for k in want} == want
    act = qc["config_groups"]["group_0"]["input_activations"]
    if scheme == "nvfp4":
        want = preset.input_activations.model_dump(mode="json")
        assert {k: act[k] for k in want} == want
    else:
        assert act is None
    from compressed_tensors.quantization import QuantizationConfig

    QuantizationConfig.model_validate(qc)  # compressed-tensors parses what we wrote

    # every quantized tensor: compressed-tensors' bytes from the source weight (fused
    # global scales for NVFP4 as llm-compressor fuses them), and its decompressor
    plan = plan_quantization(src=moe_src, scheme=scheme)[1]
    fused = {r.name: g for g in fused_groups(plan) for r in g}
    dense = {}
    for r in plan.quantized:
        parts = ck.get_parts(r.name)
        w = src.get(r.name)
        partners = [src.get(x.name) for x in fused.get(r.name, [])]
        theirs = ct_compress(w, PRESET[scheme], fused=partners)
        mine = {k: v for k, v in parts.items() if k.startswith("weight")}
        assert _same(mine, theirs), r.name
        if scheme == "nvfp4":
            assert torch.equal(parts["input_global_scale"], torch.tensor([1.0]))
        d = ct_decompress(mine, PRESET[scheme])
        assert torch.equal(_bytes(ck.get(r.name, torch.bfloat16)), _bytes(d)), r.name
        dense[r.name] = ck.get(r.name)
    if scheme != "mxfp4":  # q/k/v and gate/up share their global scale
        qkv = [f"model.layers.0.self_attn.{p}_proj.weight_global_scale" for p in "qkv"]
        gs = [ck.get_parts(n.removesuffix("_global_scale"))["weight_global_scale"] for n in qkv]
        assert gs[0] == gs[1] == gs[2]

    # transformers loads OUT (dequantized at load): every Linear it builds holds
    # compressed-tensors' bfloat16 decompression of our parts
    from transformers import CompressedTensorsConfig

    direct = _load(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    params = dict(direct.named_parameters())
    for r in plan.quantized:
        if ".experts." in r.name:
            continue
        assert torch.equal(params[r.name].float(), dense[r.name].bfloat16().float()), r.name
    # routed experts: transformers fuses them into [E, 2 * moe, hidden] / [E, hidden, moe]
    # and decompresses each with a module that has weight_packed / weight_scale /
    # weight_shape only (integrations/compressed_tensors.py, CompressedTensorsDequantize):
    # MXFP4 comes out right; NVFP4 loses weight_global_scale, so its experts load
    # multiplied by the global scale - a transformers 5.24 gap, pinned here
    gu = params["model.layers.0.mlp.experts.gate_up_proj"].float()
    g0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
    u0 = "model.layers.0.mlp.experts.0.up_proj.weight"
    want = torch.cat([dense[g0], dense[u0]], 0)
    if scheme == "mxfp4":
        assert torch.equal(gu[0], want.bfloat16().float())
        ours = tmp_path / "ours"
        ours.mkdir()
        sd = {n: (dense[n] if n in dense else src.get(n)).float().contiguous()
              for n in src.names()}  # fmt: skip
        save_file(sd, ours / "model.safetensors", metadata={"format": "pt"})
        (ours / "config.json").write_text((moe_src / "config.json").read_text())
        ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            l_direct = direct.float()(ids).logits
        l_ours = _logits(ours, ids)
        err = float((l_direct - l_ours).abs().max() / l_ours.abs().max())
        assert err <= 1e-2, err  # transformers keeps bf16-rounded weights
    else:
        gscale = float(ck.get_parts(g0)["weight_global_scale"])
        assert torch.equal(gu[0], (want * gscale).bfloat16().float())


def test_nvfp4_runtime_activations_against_transformers(tmp_path_factory):
    """transformers loading an nvfp4 OUT compressed (compressed-tensors' forward_quantize
    on every Linear input, with the stored input_global_scale 1.0) in bfloat16, vs our
    runtime with activation quantization on: the same logits. A dense model: transformers
    5.24 loads NVFP4 MoE experts without their global scale (see above), and it cannot
    run compressed FP4 in float32 on CPU (bfloat16 weights against float32 inputs)."""
    from k3convert.runtime import Runtime

    root = tmp_path_factory.mktemp("fp4_dense")
    src = save_model("llama", root / "m", dtype=torch.bfloat16)
    out = root / "nvfp4"
    quantize(src=src, out=out, scheme="nvfp4", progress=False)
    ids = torch.randint(0, 160, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = _logits(out, ids, dtype=torch.bfloat16).float()
    ck = open_checkpoint(out)
    got = {}
    for aq in (True, False):
        with Runtime(ck, dtype=torch.bfloat16, act_quant=aq) as rt:
            if aq:
                specs = set(rt.act_specs.values())
                assert specs == {get_scheme("nvfp4").act}, specs
            got[aq] = rt.forward(ids).float()
    scale = float(ref.abs().max())
    d_on = float((got[True] - ref).abs().max()) / scale
    d_off = float((got[False] - ref).abs().max()) / scale
    assert d_on <= 1e-3 and d_off > 0.02, (d_on, d_off)


def test_cli_quantize_scheme(moe_src, tmp_path):
    from k3convert.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["quantize", str(moe_src), str(tmp_path / "o"), "--scheme", "nvfp4a16"])
    assert rc == 0
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == formats.NVFP4


# -- split ------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4a16"])
def test_split_reassembles_bytes(scheme, fp4_out):
    """Rows split freely, columns on group boundaries only (32 / 16 values = 16 / 8
    bytes, the scale's columns with them); the global scale is copied whole; the pieces
    put back together are the stored bytes."""
    ck = open_checkpoint(fp4_out(scheme))
    m = ck.meta("model.layers.0.self_attn.q_proj.weight")  # [64, 64]
    grp = 32 if scheme == "mxfp4" else 16
    assert legal_degrees(m, 1, "even", 1) == [k for k in range(1, 65) if 64 % (k * grp) == 0]
    assert legal_degrees(m, 0, "even", 1) == [k for k in range(1, 65) if 64 % k == 0]
    parts = ck.get_parts(m.name)
    for d, n in [(0, 2), (0, 64), (1, 2), (1, 64 // grp)]:
        pieces = split_tensor(m, d, n)
        assert [(pc.start, pc.length) for pc in pieces] == [(k * 64 // n, 64 // n)
                                                             for k in range(n)]  # fmt: skip
        for p, t in parts.items():
            slices = [next(ps for ps in pc.parts if ps.part == p) for pc in pieces]
            if p == "weight_global_scale":
                assert all(ps.dim is None for ps in slices)
                continue
            assert all(ps.dim == d and ps.pad == 0 for ps in slices), p
            per = {"weight_packed": 2 if d == 1 else 1, "weight_scale": grp if d == 1 else 1}
            assert all(ps.length == 64 // n // per[p] for ps in slices), p
            back = torch.cat([t.narrow(d, ps.start, ps.length) for ps in slices], d)
            assert torch.equal(_bytes(back), _bytes(t)), (p, d, n)
    bad = 4 if scheme == "mxfp4" else 8
    with pytest.raises(SplitError) as ei:
        split_tensor(m, 1, bad, degree_name="tp")
    msg = str(ei.value)
    assert m.name in msg and "dim 1" in msg and f"tp={bad}" in msg and "group of" in msg
    assert f"Degrees that work for this tensor: {legal_degrees(m, 1, 'even', 1)}" in msg


def test_shard_fp4_stream_is_lossless_and_readable(fp4_out, tmp_path):
    from k3convert.shard import shard
    from k3convert.stream import check, open_stream
    from tests.test_shard_support import assert_lossless

    src = fp4_out("nvfp4")
    out = tmp_path / "st"
    shard(src=src, out=out, tp=2, progress=False)  # experts' down_proj cut at 16 columns
    assert check(out).status == "intact"
    assert_lossless(src, out)
    man = read_manifest_doc(out)
    down = [e for r in man["ranks"] for u in r["units"] for e in u["tensors"]
            if e["logical"].endswith("experts.0.down_proj.weight")]  # fmt: skip
    assert {e["encoding"] for e in down} == {formats.NVFP4}
    dims = {e["part"]: e["split_dim"] for e in down}
    assert dims == {"weight_packed": 1, "weight_scale": 1, "weight_global_scale": None,
                    "input_global_scale": None}  # fmt: skip
    s = open_stream(out)
    ck = open_checkpoint(src)
    name = "model.layers.1.mlp.experts.0.down_proj.weight"  # [64, 32] in halves
    halves = [s.rank(r).get(name) for r in range(2)]
    assert torch.equal(torch.cat(halves, 1), ck.get(name))
    assert s.rank(0).meta(name).shape == (64, 16)
    with pytest.raises(SplitError, match=r"down_proj\.weight.*dim 1"):
        shard(src=fp4_out("mxfp4"), out=tmp_path / "bad", tp=2, progress=False)


# -- requantization streams one expert at a time --------------------------------------------
@pytest.mark.parametrize("scheme", ["nvfp4a16", "int4-g32"])  # int4-g32: w4a16 with groups
@pytest.mark.parametrize("workers", [1, 2])  # of 32, which the tiny experts' dims hold
@pytest.mark.parametrize("path", ["float", "bytes"])
def test_requantize_mxfp4_source_one_tensor_at_a_time(scheme, workers, path, fp4_out, tmp_path,
                                                      monkeypatch):  # fmt: skip
    """An MXFP4 source re-quantized. Through the float path, each expert is dequantized
    on its own and dropped before more than ``workers`` are alive (weak references to
    every dequantized float tensor, counted while the writer runs); through the byte path
    (k3convert.quant.fp4_requant) no expert is dequantized to be re-encoded (only, after,
    to measure the loss where its kernel did not). The float path's output
    equals quantizing each dequantized tensor directly; the byte path's NVFP4 is the exact
    transcode (the source's values), its int4 the same bytes as the float path."""
    from k3convert.quant import fp4_requant

    if path == "float":
        monkeypatch.setattr(fp4_requant, "supported", lambda s: False)
    src = fp4_out("mxfp4")
    enc = formats.ENCODINGS[formats.MXFP4]
    alive: set[int] = set()
    peak = [0]
    calls = [0]

    def spy(parts, q, **kw):
        t = enc.dequantize(parts, q, **kw)
        calls[0] += 1
        key = calls[0]
        alive.add(key)
        peak[0] = max(peak[0], len(alive))
        weakref.finalize(t, alive.discard, key)
        return t

    # the registry entry the reader dequantizes through (one dict, shared by every user)
    monkeypatch.setitem(formats.ENCODINGS, formats.MXFP4, replace(enc, dequantize=spy))
    out = tmp_path / "re"
    # int4: the minmax observer, whose byte path equals the float path (the default for an
    # MXFP4 source, the scale search, is tests/test_mx_transcode.py's)
    obs = "minmax" if scheme.startswith("int") else None
    res = quantize(src=src, out=out, scheme=scheme, progress=False, workers=workers,
                   weight_observer=obs)  # fmt: skip
    n_fp4 = sum(open_checkpoint(src).meta(n).encoding == formats.MXFP4
                for n in open_checkpoint(src).names())  # fmt: skip
    extra = sum(len(g) for g in fused_groups(res.plan))  # NVFP4's global-scale pass
    # the loss report decodes each tensor not known to be exact once more, after its
    # output is made, except where the byte path knows it: the exact NVFP4 transcode, and
    # int4 minmax through the search kernel (its loss measured as it rounds)
    lossy = 0 if (path, scheme) == ("bytes", "nvfp4a16") else n_fp4
    known = path == "bytes" and (scheme == "nvfp4a16" or native.ENABLED)
    decoded = 0 if known else n_fp4
    assert len(res.fidelity) == n_fp4 and len(res.fidelity.exact) == n_fp4 - lossy
    if path == "bytes":  # the global amax from the group maxima too
        assert calls[0] == decoded and peak[0] <= workers
    else:
        assert calls[0] == n_fp4 + extra + decoded
        assert 1 <= peak[0] <= workers, peak[0]
    monkeypatch.undo()
    q, s = open_checkpoint(out), open_checkpoint(src)
    sch = get_scheme(scheme)
    fused = {r.name: g for g in fused_groups(res.plan) for r in g}
    for r in res.plan.quantized[:12]:
        if path == "bytes" and scheme == "nvfp4a16" and s.meta(r.name).encoding == formats.MXFP4:
            # the exact transcode: the source's values, read back by compressed-tensors
            mine = {k: v for k, v in q.get_parts(r.name).items() if k.startswith("weight")}
            got = ct_decompress(mine, PRESET[scheme])
            assert torch.equal(_bytes(got), _bytes(s.get(r.name, got.dtype))), r.name
            continue
        kw = {}
        if r.name in fused:
            kw["global_amax"] = torch.stack(
                [s.get(x.name).abs().max() for x in fused[r.name]]
            ).max()
        want = sch.quantize(s.get(r.name), **kw)
        assert _same({k: v for k, v in q.get_parts(r.name).items()}, want), r.name


def test_both_fp4_roundings_are_compressed_tensors_cast():
    """fp4_codes (a table gather) and fp4_codes_short (a search of the rounding edges, for
    GPTQ's columns) give the same codes, whose values are compressed-tensors'
    ``cast_to_fp4``: on every edge, its float32 neighbours, and random values."""
    import math

    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    from k3convert.formats.fp4 import E2M1, fp4_codes, fp4_codes_short

    vals = []
    for k in range(0, 25 * 4 + 1):
        v = k / 16
        for d in (-2, -1, 0, 1, 2):
            u = torch.tensor(v, dtype=torch.float32)
            for _ in range(abs(d)):
                u = torch.nextafter(u, torch.tensor(math.inf if d > 0 else -math.inf))
            vals += [float(u), -float(u)]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(vals, dtype=torch.float32).clamp(-6, 6),
                   (torch.randn(200_000, generator=g) * 3).clamp(-6, 6),
                   torch.tensor([0.0, -0.0, 6.0, -6.0])])  # fmt: skip
    a, b = fp4_codes(x), fp4_codes_short(x)
    assert torch.equal(a, b)
    assert torch.equal(E2M1[a.long()], cast_to_fp4(x.clone()).float())
    assert int(a[-3]) == 0  # -0.0 is code 0; a negative value rounding to 0 keeps its sign
    assert int(fp4_codes_short(torch.tensor([-0.1]))[0]) == 8
