"""FP4 decode kernels and MXFP4 -> NVFP4 / int4 requantization straight from the bytes.

Every fast path is checked bit for bit against the slow one it replaces: the decode
against ``mxfp4_reference`` / ``nvfp4_reference`` on every (scale code, byte) pair, the
requantization against the scheme's own ``quantize`` of the float32 decode (which
tests/test_formats_fp4.py and tests/test_quant_oracle.py check against compressed-tensors),
and a whole ``quantize`` run from an MXFP4 checkpoint against compressed-tensors' NVFP4
compressor. Each runs with the C kernels (:mod:`k3convert.native`) and with the torch
path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from k3convert import formats as fmt
from k3convert import native
from k3convert.checkpoint import open_checkpoint
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.quant import fp4_requant, get_scheme
from k3convert.quant.schemes import FP8Scheme, IntScheme, NonFiniteWeightError
from k3convert.quant.writer import fused_groups

#: the package was installed with its extension module built (setup.py); where a C
#: compiler is present it must have been (test_kernels_are_the_packages_extension)
HAVE_CC = native.library() is not None


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Both implementations: the C kernels (skipped without a compiler) and torch ops."""
    if request.param == "native":
        if not HAVE_CC:
            pytest.skip("no C compiler: the kernels cannot be built here")
        assert native.library() is not None, native.status()
    monkeypatch.setattr(native, "ENABLED", request.param == "native")
    return request.param


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a
    )  # fmt: skip


def _mx(rows: int, cols: int, lo: int, hi: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    codes = torch.randint(lo, hi + 1, (rows, cols // 32), generator=g).to(torch.uint8)
    packed[1, :16] = 0  # an all-zero MX group
    packed[2, :8] = 0x88  # an NVFP4 group of -0.0
    packed[3, 8:16] = 0x11  # a group whose largest value is 0.5
    return {"weight_packed": packed, "weight_scale": codes}


def _decode32(p):
    return fmt.mxfp4_reference(p, fmt.QuantParams(), torch.float32)


# -- the kernels ---------------------------------------------------------------------------
def _reset(monkeypatch):
    monkeypatch.delenv("K3CONVERT_NATIVE", raising=False)  # the case is the test's own
    for name, v in (("_tried", False), ("_lib", None), ("_why", None), ("_told", False)):
        monkeypatch.setattr(native, name, v)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the extension is optional")
def test_kernels_are_the_packages_extension(tmp_path):
    """Installed where a compiler is, the kernels are the package's own extension module,
    imported from the package directory; a process that uses them compiles nothing and
    creates no cache (HOME and XDG_CACHE_HOME point at an empty directory)."""
    if os.environ.get("K3CONVERT_NATIVE") == "0":
        pytest.skip("K3CONVERT_NATIVE=0: this run turned the kernels off")
    assert native.library() is not None, native.status()
    mod = native._import_module()
    assert Path(mod.__file__).parent == Path(native.__file__).parent
    assert mod.ABI == native.ABI
    code = (
        "import torch; from k3convert import native; from k3convert import formats as f\n"
        "p = torch.zeros(4, 16, dtype=torch.uint8)\n"
        "c = torch.full((4, 1), 127, dtype=torch.uint8)\n"
        "v = f.fp4.mx_values(torch.float32)\n"
        "assert native.fp4_decode(p, c, v, torch.float32, 32) is not None\n"
        "print(native.status())"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "in use" in r.stdout and r.stderr == ""
    assert list(tmp_path.iterdir()) == []  # no kernel cache, no build


def test_kernels_off_say_so_once(monkeypatch, capsys):
    """Without the kernels (here: K3CONVERT_NATIVE=0) the first call that falls back to
    torch prints one line on stderr with the reason and the fix; later calls print none."""
    _reset(monkeypatch)
    monkeypatch.setenv("K3CONVERT_NATIVE", "0")
    assert native.library() is None and "K3CONVERT_NATIVE=0" in native.status()
    src = torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):
        assert not native.max_codes(src, 8, torch.empty(8, dtype=torch.uint8))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "off (disabled by K3CONVERT_NATIVE=0)" in err[0]
    assert "unset K3CONVERT_NATIVE" in err[0]


@pytest.mark.parametrize("why", ["missing", "abi"])
def test_kernels_missing_or_stale_fall_back(monkeypatch, capsys, why):
    """An extension module that was not built, or was built from another source (its ABI
    number differs): the torch path, the reason in status() and the reinstall fix."""
    _reset(monkeypatch)

    def fake():
        if why == "missing":
            raise ImportError("No module named 'k3convert.native._fp4_kernels'")
        return type(sys)("_fp4_kernels")  # a module without the ABI it should carry

    monkeypatch.setattr(native, "_import_module", fake)
    assert native.library() is None
    want = "was not built" if why == "missing" else "ABI None, this k3convert needs"
    assert want in native.status()
    assert native.fp4_decode(*[torch.zeros(1, 16, dtype=torch.uint8)] * 2, None, torch.float32,
                             32) is None  # fmt: skip
    err = capsys.readouterr().err
    assert want in err and "pip install" in err


def test_version_names_the_kernels():
    env = {**os.environ, "K3CONVERT_NATIVE": "0"}
    cmd = [sys.executable, "-m", "k3convert", "--version"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0
    assert "native FP4 kernels: off (disabled by K3CONVERT_NATIVE=0)" in r.stdout


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_kernel_wrappers_refuse_bad_arguments():
    """The C loops trust their arguments; the wrappers check sizes and key ranges."""
    src = torch.zeros(64, dtype=torch.uint8)
    table = torch.zeros(256 * 2, dtype=torch.uint8)
    out = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside the table"):
        native.gather(src, torch.tensor([0, 2, 0, 0], dtype=torch.int32), table, out)
    with pytest.raises(ValueError, match="outside the table"):
        native.gather(src, torch.tensor([0, -1, 0, 0], dtype=torch.int32), table, out)
    with pytest.raises(ValueError, match="wrong dtype, size or layout"):
        native.gather(src, torch.zeros(3, dtype=torch.int32), table, out)  # 64 % 3
    with pytest.raises(ValueError, match="wrong dtype, size or layout"):
        native.max_codes(src, 8, torch.empty(7, dtype=torch.uint8))
    # the hostile cases of issue 36: a caller's decode table, d_range past int32, ranks
    p, c = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
    vals = fmt.fp4.mx_values(torch.bfloat16)
    good = native.decode_table(vals, torch.bfloat16)
    for bad in (torch.zeros(1, dtype=torch.uint8), good.to(torch.int32), good.transpose(1, 2),
                torch.empty(good.shape, dtype=torch.uint8, device="meta")):  # fmt: skip
        with pytest.raises(ValueError, match="table must be a contiguous CPU"):
            native.fp4_decode(p, c, vals, torch.bfloat16, 32, table=bad)
    q, codes = torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
    args = (q, codes, 1, torch.zeros(2048), torch.zeros(3, 16, dtype=torch.uint8), (0, 255))
    assert native.mx_int4(*args, (0, 0)) is not None
    for d_range in ((-(2**31), 2**31), (0, 2**40), (0.5, 1), (0,)):
        with pytest.raises(ValueError):
            native.mx_int4(*args, d_range)
    with pytest.raises(ValueError, match="simd must be"):
        native.max_codes(src, 8, torch.empty(8, dtype=torch.uint8), simd=None)
    assert native.threads_for(1, 2**63) == native.MAX_THREADS and native.threads_for(1, -3) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_decode_every_pair(path, dtype):
    """Every (E8M0 code, byte) pair, codes 0 (subnormal results), 254 (overflow) and 255
    (NaN) included, decodes to the reference's bits."""
    p = fmt.fp4.all_pairs(torch.uint8)
    got = fmt.fp4.decode_mxfp4(p, fmt.QuantParams(), dtype)
    assert torch.equal(_bytes(got), _bytes(fmt.mxfp4_reference(p, fmt.QuantParams(), dtype)))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_portable_loop_equals_the_simd_one(dtype):
    """The AVX2 loop (chosen at run time where the CPU has it) and the portable one give
    the reference's bits on every (code, byte) pair."""
    p = fmt.fp4.all_pairs(torch.uint8)
    want = _bytes(fmt.mxfp4_reference(p, fmt.QuantParams(), dtype))
    for simd in (True, False):
        got = native.fp4_decode(p["weight_packed"], p["weight_scale"], fmt.fp4.mx_values(dtype),
                                dtype, fmt.MX_GROUP, simd=simd)  # fmt: skip
        assert torch.equal(_bytes(got), want), simd


def test_mxfp4_torch_path_every_pair(monkeypatch):
    """Without the kernels: the (code, byte) pair-table gather, the reference's bits."""
    monkeypatch.setattr(native, "ENABLED", False)
    p = fmt.fp4.all_pairs(torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        got = fmt.fp4.decode_mxfp4(p, fmt.QuantParams(), dtype)
        want = fmt.mxfp4_reference(p, fmt.QuantParams(), dtype)
        assert torch.equal(_bytes(got), _bytes(want)), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gscale", [2688.0 / 0.05, 1.0, 1e-30, 3e38, float("inf")])
def test_nvfp4_decode_every_pair(path, dtype, gscale):
    """Every (e4m3 code, byte) pair, NaN codes and extreme global scales included (so the
    products overflow, underflow to subnormals, and meet a non-finite scale)."""
    p = fmt.fp4.all_pairs(torch.float8_e4m3fn)
    p["weight_global_scale"] = torch.tensor([gscale])
    got = fmt.fp4.decode_nvfp4(p, fmt.QuantParams(), dtype)
    assert torch.equal(_bytes(got), _bytes(fmt.nvfp4_reference(p, fmt.QuantParams(), dtype)))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_nibble_map_kernels_portable_equals_simd():
    """The requantization's byte kernels, AVX2 and portable, against torch's table path."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (64, 256), generator=g, dtype=torch.uint8)
    maps = torch.randint(0, 16, (40, 16), generator=g, dtype=torch.uint8)
    key = torch.randint(0, 40, (64, 16), generator=g, dtype=torch.int32)
    want = fp4_requant._gather_bytes(src, key, fp4_requant._byte_table(maps))
    for simd in (True, False):
        out = torch.empty_like(src)
        assert native.gather_nib(src, key.view(-1), maps.view(-1), out, simd=simd)
        assert torch.equal(out, want), simd


# -- requantization ------------------------------------------------------------------------
INT_SCHEMES = {
    "w4a16": get_scheme("w4a16"),
    "int4-g32-f32": IntScheme("t-g32", num_bits=4, group_size=32, scale_dtype="float32"),
    "int4-g64": IntScheme("t-g64", num_bits=4, group_size=64),
    "int4-channel": IntScheme("t-ch", num_bits=4, strategy="channel"),
}
NV_SCHEMES = {"nvfp4a16": get_scheme("nvfp4a16"), "nvfp4": get_scheme("nvfp4")}


@pytest.mark.parametrize("scheme", sorted(INT_SCHEMES))
@pytest.mark.parametrize("codes", [(117, 124), (16, 240), (100, 140)])
@pytest.mark.parametrize("shape", [(48, 512), (5, 96)])  # (5, 96): group counts that are
def test_requant_equals_the_float_path(path, scheme, codes, shape):  # no kernel block's multiple
    s = INT_SCHEMES[scheme]
    group = s.group_size or fmt.MX_GROUP
    if shape[1] % group:
        pytest.skip(f"groups of {group} do not tile {shape[1]} columns")
    p = _mx(*shape, *codes)
    got = fp4_requant.requantize(p, s, name="t.weight")
    assert got is not None
    assert _same(got, s.quantize(_decode32(p), name="t.weight"))


def _nv_decodes_equal(nv: dict, mx: dict) -> torch.Tensor:
    """Per value: whether the NVFP4 parts decode to the MXFP4 parts' values, bit for bit,
    in float32 and bfloat16, by the references and by compressed-tensors' decompressor."""
    from tests.test_formats_fp4 import ct_decompress

    same = None
    for dt in (torch.float32, torch.bfloat16):
        a = fmt.mxfp4_reference(mx, fmt.QuantParams(), dt)
        b = fmt.nvfp4_reference(nv, fmt.QuantParams(), dt)
        it = torch.int16 if dt == torch.bfloat16 else torch.int32
        eq = a.view(it) == b.view(it)
        same = eq if same is None else same & eq
    theirs = ct_decompress({k: v for k, v in nv.items() if k.startswith("weight")}, "NVFP4A16")
    a = fmt.mxfp4_reference(mx, fmt.QuantParams(), theirs.dtype)
    return same & (a.view(torch.int16) == theirs.view(torch.int16))


@pytest.mark.parametrize("scheme", sorted(NV_SCHEMES))
@pytest.mark.parametrize("codes", [(117, 124), (110, 127), (0, 6), (236, 249)])
@pytest.mark.parametrize("shape", [(48, 512), (5, 96)])
def test_nvfp4_transcode_is_exact(path, scheme, codes, shape):
    """Within e4m3's 18 binades of powers of two (2**-9 .. 2**8) the NVFP4 parts hold the
    MXFP4 values bit for bit (nibbles copied, a power-of-two global scale), subnormal and
    huge E8M0 codes included; compressed-tensors' decompressor reads the same values."""
    s = NV_SCHEMES[scheme]
    p = _mx(*shape, *codes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp4_requant.TranscodeLossWarning)
        got = fp4_requant.requantize(p, s, name="t.weight")
    assert torch.equal(got["weight_packed"], p["weight_packed"])
    g = float(got["weight_global_scale"])
    assert g > 0 and math.frexp(g)[0] == 0.5  # a power of two
    assert bool(_nv_decodes_equal(got, p).all())
    if scheme == "nvfp4":
        assert torch.equal(got["input_global_scale"], torch.tensor([1.0]))


def test_nvfp4_transcode_rounds_and_counts_only_groups_out_of_reach(path):
    """E8M0 codes over 224 binades: the groups within 17 binades of the largest nonzero
    group's code are exact; each group below is rounded to the nearest value the smallest
    e4m3 scale gives, and the warning counts exactly those groups."""
    p = _mx(48, 512, 16, 240)
    with pytest.warns(fp4_requant.TranscodeLossWarning) as rec:
        got = fp4_requant.requantize(p, NV_SCHEMES["nvfp4a16"], name="t.weight")
    codes = p["weight_scale"].to(torch.int64)
    vals = _decode32(p).view(48, -1, 32)
    nonzero = vals.abs().amax(-1) > 0
    top = int(codes[nonzero].max())
    out_of_reach = nonzero & (codes < top - 17)
    assert f"{int(out_of_reach.sum())} of {codes.numel()} MXFP4 groups" in str(rec[0].message)
    same = _nv_decodes_equal(got, p).view(48, -1, 32)
    assert bool(same[~out_of_reach].all())
    # the rounded groups: the nearest multiple of the smallest step on the E2M1 grid
    step = 2.0**-9 / float(got["weight_global_scale"])
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6]) * step
    x = vals[out_of_reach].abs()
    best = (x.unsqueeze(-1) - grid).abs().amin(-1)
    dec = fmt.nvfp4_reference(got, fmt.QuantParams()).view(48, -1, 32)[out_of_reach].abs()
    assert torch.equal((dec - x).abs(), best)


def test_nvfp4_fused_pair_shares_the_global_scale(path):
    """w1 / w3 (fused by vLLM, which takes one global scale for the pair): both from the
    pair's largest code, each exact where its groups are within reach of it."""
    w1, w3 = _mx(16, 256, 117, 124, seed=1), _mx(16, 256, 112, 120, seed=2)
    top = max(fp4_requant.abs_max_and_top(w1)[1], fp4_requant.abs_max_and_top(w3)[1])
    assert top == 124
    a = fp4_requant.requantize(w1, NV_SCHEMES["nvfp4a16"], top_code=top)
    b = fp4_requant.requantize(w3, NV_SCHEMES["nvfp4a16"], top_code=top)
    assert float(a["weight_global_scale"]) == float(b["weight_global_scale"]) == 2.0 ** (135 - 124)
    assert bool(_nv_decodes_equal(a, w1).all()) and bool(_nv_decodes_equal(b, w3).all())


def test_requant_declines_what_it_cannot_do_exactly(path):
    """None (the caller quantizes the float decode) for NaN codes, int codes outside
    INT_CODES, asymmetric / float16-scale / non-4-bit int schemes and misshapen parts."""
    nv, w4 = NV_SCHEMES["nvfp4a16"], INT_SCHEMES["w4a16"]
    p = _mx(16, 256, 117, 124)
    p["weight_scale"][3, 2] = 255  # E8M0 NaN
    assert fp4_requant.requantize(p, nv) is None and fp4_requant.requantize(p, w4) is None
    with pytest.raises(NonFiniteWeightError):
        nv.quantize(_decode32(p))
    lo, hi = fp4_requant.INT_CODES
    for bad in (lo - 1, hi + 1):
        q = _mx(16, 256, 117, 124)
        q["weight_scale"][0, 0] = bad
        assert fp4_requant.requantize(q, w4) is None
        loss = fp4_requant.TranscodeLossWarning
        with pytest.warns(loss, match="'t': (1|126) of 128 MXFP4 groups"):
            assert fp4_requant.requantize(q, nv, name="t") is not None  # every code
    for s in (get_scheme("w4a16-asym"), get_scheme("w3a16"), get_scheme("int8-g128"),
              IntScheme("t-f16", num_bits=4, scale_dtype="float16")):  # fmt: skip
        assert not fp4_requant.supported(s) and fp4_requant.requantize(p, s) is None
    assert fp4_requant.requantize({**p, "weight_scale": p["weight_scale"][:, :4]}, nv) is None


@pytest.mark.parametrize("code,byte", [(255, 0x00), (254, 0x44), (253, 0x66)])
def test_damaged_scales_are_refused_by_every_scheme(path, code, byte):
    """An MX group whose decode is not finite (an E8M0 NaN code; 254 with a magnitude of 2,
    253 with 4: values past float32's / bfloat16's range) is declined by every byte path,
    and the float path every scheme then takes refuses it, naming the tensor; a finite
    group at the top of the range (254 with 1.5) is not damaged."""
    p = _mx(16, 256, 117, 124)
    p["weight_scale"][3, 2] = code
    p["weight_packed"][3, 32:48] = byte
    assert not fp4_requant.decodes_finite(p["weight_packed"], p["weight_scale"])
    search = dataclasses.replace(get_scheme("int4-g32"), observer="search")
    for s in (*NV_SCHEMES.values(), get_scheme("fp8-block"), get_scheme("fp8-channel"),
              get_scheme("w4a16"), search, get_scheme("w8a8"), get_scheme("mxfp4")):  # fmt: skip
        assert fp4_requant.requantize(p, s, name="t") is None, s.name
        with pytest.raises(NonFiniteWeightError, match="tensor 't' holds NaN/Inf"):
            s.quantize(_decode32(p), name="t")
    p["weight_packed"][3, 32:48] = 0x33  # 1.5 * 2**127: finite
    assert fp4_requant.decodes_finite(p["weight_packed"], p["weight_scale"]) == (code != 255)


def test_abs_max_from_group_maxima(path):
    for lo, hi in ((117, 124), (0, 5), (200, 252)):
        p = _mx(16, 512, lo, hi)
        got = fp4_requant.abs_max_and_top(p)[0]
        assert torch.equal(got, _decode32(p).abs().max())
    p["weight_scale"][0, 0] = 255
    assert fp4_requant.abs_max_and_top(p) is None  # NaN: the float path raises with the name
    assert torch.equal(fp4_requant.abs_max_and_top(_mx(4, 64, 0, 0) | {"weight_packed": torch.zeros(
        4, 32, dtype=torch.uint8)})[0], torch.zeros(()))  # fmt: skip


# -- a whole quantize run from an MXFP4 checkpoint -------------------------------------------
@pytest.fixture(scope="module")
def mx_src(tmp_path_factory):
    from tests.models import save_model

    root = tmp_path_factory.mktemp("mx_src")
    bf16 = save_model("qwen3_moe", root / "bf16", dtype=torch.bfloat16)
    quantize(src=bf16, out=root / "mxfp4", scheme="mxfp4", progress=False, workers=1)
    return root / "mxfp4"


@pytest.mark.parametrize(
    "scheme,observer",
    [("nvfp4a16", None), ("int4-g32", "minmax"), ("int4-g32", None), ("fp8-block-w", None)],
)
def test_quantize_from_mxfp4_same_bytes_every_path(mx_src, tmp_path, monkeypatch, scheme, observer):
    """`quantize` of an MXFP4 checkpoint writes the same files through the C kernels and
    through fp4_requant's torch ops; int4 with the minmax observer also through the
    float32 decode + scheme.quantize (the default for an MXFP4 source, the scale search,
    has no float path). NVFP4: every MXFP4 tensor's parts decode (compressed-tensors'
    decompressor) to the source's values bit for bit, and each fused set (gate / up)
    shares one global scale, as vLLM's fused MoE and Linear layers take one."""
    calls = []
    real = fp4_requant.requantize
    byte_path = fp4_requant.supported

    def counted(*a, **kw):
        got = real(*a, **kw)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(fp4_requant, "requantize", counted)
    outs = {}
    hows = (["native"] if HAVE_CC else []) + ["torch"] + (["float"] if observer else [])
    for how in hows:
        monkeypatch.setattr(native, "ENABLED", how == "native")
        float_path = (lambda s: False) if how == "float" else byte_path
        monkeypatch.setattr(fp4_requant, "supported", float_path)
        calls.clear()
        out = tmp_path / how
        quantize(
            src=mx_src, out=out, scheme=scheme, progress=False, workers=1, weight_observer=observer
        )
        if how != "float":
            assert len(calls) >= 8 and all(calls), (how, calls)  # every expert: no fallback
        else:
            assert not calls
        outs[how] = {
            p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".safetensors"
        }
    assert all(o == outs["torch"] for o in outs.values())
    if scheme != "nvfp4a16":
        return
    from tests.test_formats_fp4 import ct_decompress

    ck, src = open_checkpoint(tmp_path / "torch"), open_checkpoint(mx_src)
    plan = plan_quantization(src=mx_src, scheme=scheme)[1]
    experts = 0
    for r in plan.quantized:
        if src.meta(r.name).encoding != fmt.MXFP4:
            continue
        experts += ".experts." in r.name
        mine = {k: v for k, v in ck.get_parts(r.name).items() if k.startswith("weight")}
        assert torch.equal(_bytes(ct_decompress(mine, "NVFP4A16")),
                           _bytes(src.get(r.name, torch.bfloat16))), r.name  # fmt: skip
    assert experts >= 8
    pairs = 0
    for g in fused_groups(plan):
        scales = {float(ck.get_parts(r.name)["weight_global_scale"]) for r in g}
        assert len(scales) == 1, [r.name for r in g]
        pairs += 1
    assert pairs >= 8
    shutil.rmtree(tmp_path)


# -- threads: every kernel's bytes at nthreads 1, 2 and 3 ------------------------------------
THREADS = (1, 2, 3)
#: the FP4 decode's vector ISA levels this CPU runs (2 AVX-512 VBMI, 1 AVX2, 0 portable)
LEVELS = tuple(range(native.simd_level(), -1, -1))
#: (rows, bytes per row): tiny (fewer groups than threads), odd row counts and group
#: counts no thread count divides, and one large enough to split into many blocks
THREAD_SHAPES = [(1, 16), (3, 16), (7, 48), (33, 272), (301, 784)]


def _rand(shape, seed, lo=0, hi=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)


def _each_thread_count(run):
    """run(nthreads) for 1, 2, 3 threads: every result byte for byte the one-thread one."""
    first = None
    for n in THREADS:
        got = [_flat(t) for t in run(n)]
        if first is None:
            first = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True)), n
    return first


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("rows,cols", THREAD_SHAPES)
def test_kernels_same_bytes_at_any_thread_count(rows, cols):
    """Each kernel at 1, 2, 3 threads on tensors from one group to several hundred rows of
    group counts no thread count divides: the same bytes, and the reference's (so a range
    the threads skip, overlap or misplace fails here)."""
    packed, seed = _rand((rows, cols), rows * cols), rows + cols
    mx = _rand((rows, cols // 16), seed, 0, 256)
    # the gathers: one key per 16 bytes, tables of each word size
    key = _rand((rows * cols // 16,), seed + 1, 0, 3).to(torch.int32)
    for word in (torch.uint8, torch.int32, torch.int64):
        table = torch.randint(-99, 99, (3 * 256,), generator=torch.Generator().manual_seed(4))
        table = table.to(word)
        want = table[(key.long().repeat_interleave(16) << 8) | packed.view(-1).long()]
        got = _each_thread_count(lambda n, t=table: [_gather_out(packed, key, t, n)])
        assert torch.equal(got[0], _flat(want)), word
    # group maxima of 8 and 16 bytes, AVX2 and portable
    for per in (8, 16):
        want = _max_codes_ref(packed, per)
        for simd in (True, False):
            got = _each_thread_count(lambda n, per=per, s=simd: [_max_out(packed, per, n, s)])
            assert torch.equal(got[0], _flat(want)), (per, simd)
    # MXFP4 decode, every loop and both dtypes, against the reference
    p = {"weight_packed": packed, "weight_scale": mx}
    for dtype in (torch.bfloat16, torch.float32):
        want = _flat(fmt.mxfp4_reference(p, fmt.QuantParams(), dtype))
        for simd in LEVELS:
            got = _each_thread_count(lambda n, d=dtype, s=simd: [native.fp4_decode(
                packed, mx, fmt.fp4.mx_values(d), d, fmt.MX_GROUP, simd=s,
                nthreads=n)])  # fmt: skip
            assert torch.equal(got[0], want), (dtype, simd)
    # the nibble maps of the requantization, AVX2 and portable
    maps = _rand((40, 16), seed + 2, 0, 16)
    nkey = _rand((rows * cols // 16,), seed + 3, 0, 40).to(torch.int32)
    want = fp4_requant._gather_bytes(packed, nkey.view(rows, -1), fp4_requant._byte_table(maps))
    for simd in (True, False):
        got = _each_thread_count(lambda n, s=simd: [_nib_out(packed, nkey, maps, s, n)])
        assert torch.equal(got[0], _flat(want)), simd


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize(
    "rows,cols,block",
    [(1, 16, (1, 32)), (6, 64, (3, 64)), (9, 192, (3, 128)), (256, 448, (128, 128))],
)
@pytest.mark.parametrize("codes", ["near 127", "zero blocks", "wide", "past float32"])
def test_fp8_block_kernel_every_loop_and_thread_count(rows, cols, block, codes, monkeypatch):
    """The one-pass MXFP4 -> FP8-block kernel, every loop this CPU runs, at 1, 2, 3 threads
    (1 to 2 bands of block rows each): the torch steps' bytes, scales and exactness, and
    the same refusal where a block's scale leaves float32's normal range."""
    packed = _rand((rows, cols), rows * cols)
    lo, hi = {"near 127": (118, 130), "zero blocks": (118, 130), "wide": (3, 250),
              "past float32": (1, 7)}[codes]  # fmt: skip
    sc = _rand((rows, cols // 16), rows + cols, lo, hi)
    if codes == "zero blocks":  # every other block row all zeros (and one group of -0)
        for r0 in range(0, rows, 2 * block[0]):
            packed[r0 : r0 + block[0]] = 0
        packed[0, :16] = 0x88
    scheme = FP8Scheme("fp8-block", strategy="block", block=block)
    monkeypatch.setattr(native, "ENABLED", False)
    stats: dict = {}
    want = fp4_requant._fp8_bytes(packed, sc, scheme, stats)
    monkeypatch.setattr(native, "ENABLED", True)
    for simd in LEVELS:
        got = [native.mx_fp8_block(packed, sc, block, fp4_requant._fp8_byte_table(),
                                   fp4_requant._fp8_exact_top(), simd=simd, nthreads=n)
               for n in THREADS]  # fmt: skip
        if want is None:
            assert all(g is None for g in got), simd
            continue
        for q, e, miss in got:
            assert torch.equal(q, want["weight"].view(torch.uint8)), simd
            assert torch.equal(torch.ldexp(torch.ones(e.shape), (e - 8).float()),
                               want["weight_scale"]), simd  # fmt: skip
            assert (miss == 0) == stats["exact"], (simd, miss)
    assert (want is None) == (codes == "past float32")


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("rows,cols", [(1, 8), (3, 24), (7, 48), (301, 776)])
@pytest.mark.parametrize("gscale", [2688.0 / 0.05, 1e-30, 3e38, 0.0])
def test_nvfp4_nibble_table_kernel_every_loop_and_thread_count(rows, cols, gscale):
    """The NVFP4 nibble-table kernel, every loop this CPU runs (AVX-512 VBMI, AVX2,
    portable), bfloat16 and float32, at 1, 2, 3 threads, on odd group counts (a last group
    without its pair) and every e4m3 code (NaN and subnormal scales, products that overflow
    or underflow): nvfp4_reference's bits."""
    packed = _rand((rows, cols), rows * cols)
    codes = _rand((rows, cols // 8), rows + cols)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(256, dtype=torch.uint8)[
        : codes.numel()]  # fmt: skip
    p = {"weight_packed": packed, "weight_scale": codes.view(torch.float8_e4m3fn),
         "weight_global_scale": torch.tensor([gscale])}  # fmt: skip
    g = p["weight_global_scale"].reshape(1, 1)
    for dtype in (torch.bfloat16, torch.float32):
        want = _flat(fmt.nvfp4_reference(p, fmt.QuantParams(), dtype))
        vals = fmt.fp4.nv_values(g, dtype)
        for simd in LEVELS:
            got = _each_thread_count(lambda n, d=dtype, v=vals, s=simd: [native.fp4_decode(
                packed, codes, v, d, fmt.NV_GROUP, simd=s, nthreads=n)])  # fmt: skip
            assert torch.equal(got[0], want), (dtype, simd)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("scheme", ["w4a16", "int4-g32-f32", "int4-channel"])
@pytest.mark.parametrize("rows,cols", [(4, 256), (5, 256), (7, 640), (37, 640)])
def test_int4_kernel_every_loop_and_thread_count(scheme, rows, cols, monkeypatch):
    """The one-pass MXFP4 -> int4 kernel, AVX2 and portable, at 1, 2, 3 threads (4 to 740
    int groups, most counts odd): the torch path's bytes and the float path's
    (scheme.quantize of the float32 decode); a code outside INT_CODES is counted."""
    s = INT_SCHEMES[scheme]
    p = _mx(rows, cols, 100, 140, seed=rows)
    monkeypatch.setattr(native, "ENABLED", False)
    want = fp4_requant.requantize(p, s, name="t.weight")
    monkeypatch.setattr(native, "ENABLED", True)
    assert want is not None and _same(want, s.quantize(_decode32(p), name="t.weight"))
    g = cols if s.strategy == "channel" else s.group_size
    args = (p["weight_packed"], p["weight_scale"], g // 32,
            fp4_requant._values()[:, :8].reshape(-1).contiguous(),
            fp4_requant._int_table(s, "weight", fp4_requant.D_HI - fp4_requant.D_LO + 1),
            fp4_requant.INT_CODES, (fp4_requant.D_LO, fp4_requant.D_HI))  # fmt: skip
    for simd in (True, False):

        def run(n, simd=simd):
            q, amax, bad = native.mx_int4(*args, simd=simd, nthreads=n)
            assert bad == 0
            return [q, s.symmetric_scale(amax)]

        got = _each_thread_count(run)
        assert torch.equal(got[0], _flat(want["weight_packed"])), simd
        assert torch.equal(got[1], _flat(want["weight_scale"])), simd
    codes = p["weight_scale"].clone()
    codes.view(-1)[-1], codes.view(-1)[0] = fp4_requant.INT_CODES[1] + 1, 0
    for n in THREADS:
        assert native.mx_int4(args[0], codes, *args[2:], nthreads=n)[2] == 2, n


def _flat(t):
    return _bytes(t).reshape(-1)


def _max_codes_ref(packed, per):
    b = packed.view(packed.shape[0], -1, per)
    return torch.maximum(b & 7, (b >> 4) & 7).amax(-1)


def _gather_out(packed, key, table, n):
    out = torch.empty(packed.shape, dtype=table.dtype)
    assert native.gather(packed, key, table, out, nthreads=n)
    return out


def _max_out(packed, per, n, simd=True):
    out = torch.empty(packed.numel() // per, dtype=torch.uint8)
    assert native.max_codes(packed, per, out, simd=simd, nthreads=n)
    return out


def _nib_out(packed, key, maps, simd, n):
    out = torch.empty_like(packed)
    assert native.gather_nib(packed, key, maps.view(-1), out, simd=simd, nthreads=n)
    return out


@pytest.mark.parametrize("grain", [5, 9])
def test_int4_scales_by_row_blocks(path, grain, monkeypatch):
    """The int4 scales computed a block of rows at a time (each op under torch's grain):
    the float path's bytes with blocks of one row and of two rows with a partial last."""
    monkeypatch.setattr(fp4_requant, "_GRAIN", grain)
    s = INT_SCHEMES["w4a16"]
    p = _mx(47, 512, 117, 124)
    got = fp4_requant.requantize(p, s, name="t.weight")
    assert got is not None and _same(got, s.quantize(_decode32(p), name="t.weight"))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_thread_policy_and_callers_at_torch_thread_counts(monkeypatch):
    """threads_for: torch's count from PAR_MIN_BYTES of output, 1 below, an explicit count
    as given (at least 1); and the callers (decode, requant) at torch threads 1, 2, 3 with
    every tensor split: the references' bytes."""
    assert native.threads_for(native.PAR_MIN_BYTES - 1) == 1
    assert native.threads_for(native.PAR_MIN_BYTES) == torch.get_num_threads()
    assert native.threads_for(0, 3) == 3 and native.threads_for(1 << 30, 0) == 1
    with pytest.raises(ValueError, match="nthreads"):
        native.threads_for(0, True)
    monkeypatch.setattr(native, "PAR_MIN_BYTES", 0)
    mx = _mx(37, 1536, 16, 240, seed=5)
    nv = {"weight_packed": mx["weight_packed"],
          "weight_scale": _rand((37, 1536 // 16), 6).view(torch.float8_e4m3fn),
          "weight_global_scale": torch.tensor([448.0 * 6 / 3.5])}  # fmt: skip
    q = fmt.QuantParams()
    before = torch.get_num_threads()
    try:
        for n in THREADS:
            torch.set_num_threads(n)
            for dtype in (torch.bfloat16, torch.float32):
                assert torch.equal(_flat(fmt.fp4.decode_mxfp4(mx, q, dtype)),
                                   _flat(fmt.mxfp4_reference(mx, q, dtype)))  # fmt: skip
                assert torch.equal(_flat(fmt.fp4.decode_nvfp4(nv, q, dtype)),
                                   _flat(fmt.nvfp4_reference(nv, q, dtype)))  # fmt: skip
            for s in ("w4a16", "int4-channel"):
                got = fp4_requant.requantize(mx, INT_SCHEMES[s], name="t.weight")
                want = INT_SCHEMES[s].quantize(_decode32(mx), name="t.weight")
                assert got is not None and _same(got, want), (n, s)
            with warnings.catch_warnings():  # 224 binades: some groups rounded, counted
                warnings.simplefilter("ignore", fp4_requant.TranscodeLossWarning)
                got = fp4_requant.requantize(mx, NV_SCHEMES["nvfp4a16"], name="t.weight")
            if n == THREADS[0]:
                first = got
            assert _same(got, first), n
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_simd_level_is_what_the_cpu_reports():
    """The kernels' widest loop follows the CPU's own flags (Linux x86-64's /proc/cpuinfo):
    AVX-512 VBMI where it has avx512bw and avx512vbmi, else AVX2 where it has avx2; the
    level they run at is that capped by torch's (ATEN_CPU_CAPABILITY=default / avx2)."""
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not info.is_file():
        pytest.skip("reads the flags of Linux x86-64's /proc/cpuinfo")
    if native.library() is None:
        pytest.skip(native.status())
    flags = set()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    want = 2 if {"avx512bw", "avx512vbmi"} <= flags else 1 if "avx2" in flags else 0
    assert native.cpu_level() == want, (sorted(f for f in flags if f.startswith("avx")), want)
    cap = {"DEFAULT": 0, "AVX2": 1}.get(torch.backends.cpu.get_cpu_capability(), 2)
    assert native.simd_level() == min(want, cap) == LEVELS[0] and LEVELS[-1] == 0


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_kept_decode_tables_follow_the_global_scale_and_dtype():
    """formats keeps the kernel's NVFP4 table per (global scale, dtype): tensors under
    alternating global scales and dtypes in one process each decode to the reference's
    bits (a table kept under the wrong key would hand one tensor another's values)."""
    packed = _rand((6, 64), 7)
    codes = _rand((6, 8), 8).clamp(max=0x7E)  # finite e4m3 scales
    for gscale, dtype in [(448.0, torch.bfloat16), (3.5, torch.bfloat16), (448.0, torch.float32),
                          (3.5, torch.bfloat16), (448.0, torch.bfloat16)]:  # fmt: skip
        p = {"weight_packed": packed, "weight_scale": codes.view(torch.float8_e4m3fn),
             "weight_global_scale": torch.tensor([gscale])}  # fmt: skip
        got = fmt.fp4.decode_nvfp4(p, fmt.QuantParams(), dtype)
        assert torch.equal(_flat(got), _flat(fmt.nvfp4_reference(p, fmt.QuantParams(), dtype)))


# -- the exact transcode on the runtime: a Kimi K3 ------------------------------------------
def test_k3_transcoded_to_nvfp4_runs_bit_identical_to_the_release(tmp_path, capsys):
    """A scaled-down Kimi K3 (MXFP4 routed experts, as released) with its experts
    transcoded to NVFP4 (nvfp4a16) gives the float32 logits of the MXFP4 original bit
    for bit; with one expert's E8M0 codes stretched over 28 binades, the groups out of
    e4m3's reach are rounded, and the run names that tensor."""
    from safetensors.torch import load_file, save_file

    from k3convert.cli import main

    src, out = tmp_path / "k3", tmp_path / "nv"
    assert main(["synth", "kimi-k3", str(src), "--tiny"]) == 0
    recipe = tmp_path / "experts.yaml"
    recipe.write_text(
        "version: 1\nquantize:\n  rules:\n    - {roles: [experts], scheme: nvfp4a16}\n"
    )
    assert main(["quantize", str(src), str(out), "--recipe", str(recipe)]) == 0
    ids = "1 2 3 4 5 6 7"
    for d in (src, out):
        assert main(["forward", str(d), "--ids", ids, "--dtype", "fp32",
                     "--save-logits", str(tmp_path / f"{d.name}.logits")]) == 0  # fmt: skip
    a, b = (load_file(tmp_path / f"{n}.logits") for n in ("k3", "nv"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(
        torch.int32)) for k in a)  # fmt: skip
    ck = open_checkpoint(out)
    experts = [n for n in ck.names() if ".experts." in n and ck.meta(n).encoding == fmt.NVFP4]
    assert len(experts) >= 16
    doc = json.loads((out / "transcode_report.json").read_text())
    assert doc["tensors"] == doc["exact"] == len(experts) and doc["values_changed"] == 0
    assert {e["name"] for e in doc["entries"]} == set(experts)
    assert "hold every released value (bit-exact)" in capsys.readouterr().out
    # 28 binades: one expert's first group 28 below the rest (its w3 partner shares the top)
    st = load_file(src / "model.safetensors")
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    codes = st[f"{name}.weight_scale"]
    codes[0, 0] = int(codes.max()) - 28
    st[f"{name}.weight_packed"][0, :16] = 0x77  # that group's values nonzero (6.0)
    save_file(st, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(fp4_requant.TranscodeLossWarning) as rec:
        assert main(["quantize", str(src), str(tmp_path / "nv2"), "--recipe", str(recipe)]) == 0
    said = [str(w.message) for w in rec]
    assert len(said) == 1 and said[0].startswith(f"'{name}.weight': 1 of "), said
    doc = json.loads((tmp_path / "nv2" / "transcode_report.json").read_text())
    assert doc["exact"] == doc["tensors"] - 1 and doc["worst"] == [f"{name}.weight"]
    bad = next(e for e in doc["entries"] if e["name"] == f"{name}.weight")
    assert not bad["exact"] and bad["groups_changed"] == 1 and bad["changed"] == 32
    assert f"worst: {name}.weight (rel err" in capsys.readouterr().out


def test_cli_shows_its_own_warnings_as_one_line(capsys):
    """The console entry shows k3convert's warnings (the transcode's rounded groups) as
    one ``warning:`` line, without Python's file / line prefix."""
    from k3convert import cli

    cli._show_warning(fp4_requant.TranscodeLossWarning("'x': 1 of 2 MXFP4 groups"),
                      fp4_requant.TranscodeLossWarning, "f.py", 1)  # fmt: skip
    assert capsys.readouterr().err == "warning: 'x': 1 of 2 MXFP4 groups\n"


# -- the writer's shared scales and read-ahead ------------------------------------------------
def test_shared_scales_computed_once_per_set_as_reached(mx_src, monkeypatch):
    """The fused sets' shared scales are computed when a member is first asked for, once
    per set however many workers ask at once, and equal what every member's own group
    maxima give (largest |value| from the decode, largest E8M0 code of a nonzero group)."""
    import threading

    from k3convert.quant import writer

    ck = open_checkpoint(mx_src)
    plan = plan_quantization(src=mx_src, scheme="nvfp4a16")[1]
    sets = fused_groups(plan)
    assert len(sets) >= 8
    calls: list = []
    real = writer._set_scale
    monkeypatch.setattr(writer, "_set_scale", lambda c, m: calls.append(m) or real(c, m))
    shared = writer.shared_amax(ck, plan)
    assert bool(shared) and not calls  # nothing read before the writer asks
    names = [r.name for g in sets for r in g] * 3
    got: dict = {}

    def ask(ns):
        got.update({n: shared.get(n) for n in ns})

    ths = [threading.Thread(target=ask, args=(names[i::4],)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert len(calls) == len(sets)
    for g in sets:
        want_top = max(float(ck.get(r.name).abs().amax()) for r in g)
        codes = [fp4_requant.abs_max_and_top(ck.get_parts(r.name))[1] for r in g]
        assert {float(got[r.name].amax) for r in g} == {want_top}
        assert {got[r.name].top_code for r in g} == {max(c for c in codes if c is not None)}
    assert shared.get("not.a.fused.weight") is None


def test_read_ahead_advises_the_rows_ahead_in_order(mx_src, monkeypatch):
    """The writer's read-ahead hands out every row in order and asks the kernel for the
    source bytes of the row `ahead` places later (only rows of at least READ_AHEAD_MIN
    bytes); advice that fails is ignored; every descriptor it opened is closed."""
    import os

    from k3convert.quant import writer

    ck = open_checkpoint(mx_src)
    plan = plan_quantization(src=mx_src, scheme="nvfp4a16")[1]
    rows = plan.rows
    advised: list = []
    monkeypatch.setattr(writer, "READ_AHEAD_MIN", 0)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advised.append((off, n)))
    before = len(os.listdir("/proc/self/fd"))
    start = {}  # row -> the byte ranges of its parts
    for r in rows:
        start[r.name] = {(p.raw.start, p.raw.nbytes) for p in ck.meta(r.name).parts.values()
                         if p.raw is not None and p.raw.nbytes}  # fmt: skip
    got = []
    for i, r in enumerate(writer._read_ahead(ck, rows, 2)):
        got.append(r)  # by the time row i is handed out, rows up to i + 2 were advised
        seen = set(advised)
        assert all(start[x.name] <= seen for x in rows[: i + 3]), i
        assert not any(start[x.name] & seen for x in rows[i + 3 :] if start[x.name]), i
    assert got == rows
    assert sorted(advised) == sorted(set().union(*start.values()))
    assert len(os.listdir("/proc/self/fd")) == before

    def fail(*a):
        raise OSError(22, "no")

    monkeypatch.setattr(os, "posix_fadvise", fail)
    assert list(writer._read_ahead(ck, rows, 3)) == rows
    assert len(os.listdir("/proc/self/fd")) == before


def test_check_scale_reads_e4m3_nan_bytes():
    from k3convert.quant.writer import _check_scale

    s = torch.full((4, 8), 2.0).to(torch.float8_e4m3fn)
    _check_scale("m.weight_scale", s, Path("/x"))
    for byte in (0x7F, 0xFF):
        bad = s.clone()
        bad.view(torch.uint8)[1, 2] = byte
        with pytest.raises(NonFiniteWeightError, match="1 of its 32 value"):
            _check_scale("m.weight_scale", bad, Path("/x"))
    b = torch.ones(3, 3, dtype=torch.bfloat16)
    b[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightError, match="1 of its 9"):
        _check_scale("m.input_scale", b, Path("/x"))


def test_damaged_fused_member_refused_before_writing(mx_src, tmp_path):
    """A fused-set member stored as MXFP4 whose scales decode past float32 is refused when
    the shared scales are prepared (before the first output byte), naming the tensor;
    an intact source passes the same check."""
    from k3convert.quant import writer
    from tests.models import edit_tensors

    plan = plan_quantization(src=mx_src, scheme="nvfp4a16")[1]
    writer.shared_amax(open_checkpoint(mx_src), plan).check_release()
    bad = tmp_path / "bad"
    shutil.copytree(mx_src, bad)
    name = next(r.name for g in fused_groups(plan) for r in g if ".experts." in r.name)

    def damage(sd) -> bool:
        if f"{name}_scale" not in sd:
            return False
        sd[f"{name}_scale"][0, 0] = 254
        sd[f"{name}_packed"][0, :16] = 0x77
        return True

    edit_tensors(bad, damage)
    shared = writer.shared_amax(open_checkpoint(bad), plan)
    with pytest.raises(NonFiniteWeightError, match=f"'{name}' holds NaN/Inf"):
        shared.check_release()
