"""An MXFP4 release transcoded to FP8 (power-of-two block scales, exact where e4m3 reaches)
and to int4 (each group's scale searched), and the loss report that says what changed.

The references here are written independently of k3convert's code paths: the FP8 blocks
from their definition (``x / 2**(floor(log2(amax)) - 8)`` cast to e4m3), the int4 search
as a brute-force float64 loop over the candidates and, for the quality target, every
bfloat16 scale between ``amax / 10`` and ``amax / 4``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from k3convert import formats as fmt
from k3convert import native
from k3convert.quant import fidelity, fp4_requant, get_scheme, mx_int4
from k3convert.quant.schemes import quantize_mxfp4

HAVE_CC = native.library() is not None
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native" and not HAVE_CC:
        pytest.skip("no C compiler: the kernels cannot be built here")
    monkeypatch.setattr(native, "ENABLED", request.param == "native")
    return request.param


def _decode(p) -> torch.Tensor:
    return fmt.mxfp4_reference(p, fmt.QuantParams(), torch.float32)


def _release(rows: int, cols: int, seed: int = 0, spread: float = 0.3) -> dict:
    """A K3-like MXFP4 tensor: Gaussian rows of varied scale, quantized to MXFP4."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w *= torch.exp(torch.randn(rows, 1, generator=g) * spread)
    w[1, :64] = 0  # two zero MX groups
    w[2, 32:64] *= 2.0**-5  # one group 5 binades below its row
    return quantize_mxfp4(w)


def _search(scheme: str):
    return dataclasses.replace(get_scheme(scheme), observer="search")


# -- FP8 --------------------------------------------------------------------------------
def _fp8_reference(x: torch.Tensor, block=(128, 128)):
    """(values, scales) of the exact transcode by definition: per block the power of two
    putting its largest value at 256 or 384, the quotient rounded to e4m3."""
    out, inp = x.shape
    b0, b1 = block
    deq = torch.empty_like(x)
    scales = torch.empty(-(-out // b0), -(-inp // b1))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            amax = float(blk.abs().max())
            s = (
                2.0 ** (torch.floor(torch.log2(torch.tensor(amax))).item() - 8)
                if amax
                else 2.0**-126
            )
            scales[i, j] = s
            deq[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (blk / s).to(
                torch.float8_e4m3fn
            ).float() * s
    return deq, scales


@pytest.mark.parametrize("shape", [(256, 512), (200, 384)])
def test_fp8_block_from_mxfp4_is_the_exact_transcode(path, shape):
    """fp8-block from MXFP4: power-of-two block scales, every value of a block within e4m3's
    17 binades of its largest held bit for bit; the stored layout is vLLM's block FP8."""
    p = _release(*shape)
    x = _decode(p)
    s = get_scheme("fp8-block")
    got = fp4_requant.requantize(p, s, name="t")
    assert got["weight"].dtype == torch.float8_e4m3fn and got["weight_scale"].dtype == torch.float32
    assert tuple(got["weight_scale"].shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    want, scales = _fp8_reference(x)
    assert torch.equal(got["weight_scale"], scales)
    deq = s.dequantize(got)
    assert torch.equal(deq, want)
    assert torch.equal(deq, x)  # these blocks span fewer than 17 binades: nothing moves
    generic = s.dequantize(s.quantize(x))  # amax / 448 scales: what the issue measured
    assert float((generic != x).float().mean()) > 0.2


def test_fp8_block_fast_path_equals_the_general_one(path):
    """The whole-block path (block maxima on the bfloat16 bits, a power-of-two multiply in
    bfloat16) writes the bytes of the scheme's general ue8m0 path, zero blocks included;
    blocks at the extremes of the exponent range take the general path."""
    import dataclasses as dc

    s = get_scheme("fp8-block")
    general = dc.replace(s, scale_fmt="ue8m0")
    for seed, lo, hi in ((0, 110, 135), (1, 1, 20), (2, 230, 250)):
        p = _release(256, 384, seed=seed)
        g = torch.Generator().manual_seed(seed)
        p["weight_scale"] = torch.randint(lo, hi, p["weight_scale"].shape, generator=g).to(
            torch.uint8
        )
        p["weight_packed"][:128, :64] = 0  # a zero block
        x = fmt.mxfp4_reference(p, fmt.QuantParams(), torch.bfloat16)
        got = fp4_requant.requantize(p, s, name="t")
        want = general.quantize(x, name="t")
        assert torch.equal(got["weight_scale"], want["weight_scale"]), seed
        assert torch.equal(got["weight"].view(torch.uint8), want["weight"].view(torch.uint8))


def test_fp8_block_rounds_only_values_out_of_reach(path):
    """A block whose values span 28 binades: the values more than 17 binades below its
    largest are rounded (to the reference's nearest), every other value is exact."""
    p = _release(128, 256, seed=3)
    p["weight_scale"][5, 0] = int(p["weight_scale"].max()) - 28
    p["weight_packed"][5, :16] = 0x77
    x = _decode(p)
    s = get_scheme("fp8-block")
    deq = s.dequantize(fp4_requant.requantize(p, s, name="t"))
    want, _ = _fp8_reference(x)
    assert torch.equal(deq, want)
    moved = deq != x
    assert moved[5, :32].all() and int(moved.sum()) == 32
    loss = fidelity.measure("t", fmt.MXFP4, "fp8-block", x, deq, (1, 32))
    assert (loss.changed, loss.groups_changed, loss.groups) == (32, 1, 128 * 8)
    assert not loss.exact and 0 < loss.rel_err < 1e-6


# -- int4: the per-group scale search -------------------------------------------------------
def _brute(x: torch.Tensor, group: int):
    """(scale bf16, q int) of the first smallest float64 squared error over mx_int4's
    candidates, every group evaluated on its own: the definition of the search."""
    out, inp = x.shape
    g = x.view(out, inp // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    best_e = best_s = best_q = None
    for t in mx_int4.DENOMS:
        sc = (amax / t).to(torch.bfloat16).clamp(min=torch.finfo(torch.bfloat16).tiny)
        q = torch.round((g / sc.float()).clamp(-8, 7))
        dq = (q.to(torch.bfloat16) * sc).float()
        e = (dq.double() - g.double()).square().sum(-1, keepdim=True)
        if best_e is None:
            best_e, best_s, best_q = e, sc, q
        else:
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s = torch.where(better, sc, best_s)
            best_q = torch.where(better, q, best_q)
    return best_s.squeeze(-1), best_q.view(out, inp)


@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64", "w4a16"])
@pytest.mark.parametrize("shape", [(64, 512), (33, 1024)])
def test_int4_search_is_the_first_best_candidate(path, scheme, shape):
    """Every group's scale and codes are those of the brute-force search over the same
    candidates (the first of equal errors), bit for bit, with the kernels and without."""
    s = _search(scheme)
    p = _release(*shape, seed=shape[0])
    x = _decode(p)
    got = fp4_requant.requantize(p, s, name="t")
    scale, q = _brute(x, s.group_size)
    assert torch.equal(got["weight_scale"].view(torch.int16), scale.view(torch.int16))
    from k3convert.formats.intn import unpack_int32

    assert torch.equal(unpack_int32(got["weight_packed"], 4, tuple(x.shape)), q.to(torch.int8))


def test_int4_search_kernel_equals_torch_at_any_thread_count(monkeypatch):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    p = _release(301, 1024, seed=7)
    for scheme in ("int4-g32", "w4a16"):
        s = _search(scheme)
        monkeypatch.setattr(native, "ENABLED", False)
        want = fp4_requant.requantize(p, s)
        monkeypatch.setattr(native, "ENABLED", True)
        for n in (1, 2, 3):
            with torch.inference_mode():
                torch.set_num_threads(n)
                got = fp4_requant.requantize(p, s)
            for k in want:
                assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), (scheme, n)
    torch.set_num_threads(2)


@pytest.mark.parametrize("observer", ["search", "minmax"])
@pytest.mark.parametrize(
    "scheme,lo,hi",
    [("int4-g32", 117, 125), ("w4a16", 110, 127), ("int4-g64", 100, 127), ("w4a16", 16, 240)],
)
def test_int4_kernel_measures_its_own_loss(monkeypatch, scheme, lo, hi, observer):
    """The loss the search kernel measures while it rounds (no decode of the output) is
    what :func:`fidelity.measure` gives from the release's decode and the output's
    dequantization: the same counts, largest error and relative error (its sums are exact,
    measure's are float64 in another order), portable and AVX2 loops, 1 to 3 threads.
    Groups left out of the search (more than 7 binades down: rounded to zero) included.
    ``minmax`` with the report runs as the search over minmax's one candidate: its bytes
    are ``scheme.quantize`` of the float32 decode's (and the minmax kernel's, which runs
    where no report is asked)."""
    if not HAVE_CC:
        pytest.skip("no C compiler")
    s = dataclasses.replace(get_scheme(scheme), observer=observer)
    assert mx_int4.applies(s)
    p = _release(96, 1024, seed=lo, spread=0.3 if observer == "search" else 1.5)
    g = torch.Generator().manual_seed(hi)
    p["weight_scale"] = torch.randint(lo, hi, p["weight_scale"].shape, generator=g).to(torch.uint8)
    x = _decode(p)
    plain = fp4_requant.requantize(p, s)  # no report asked
    if observer == "minmax":
        assert all(torch.equal(v, s.quantize(x)[k]) for k, v in plain.items())
    want = fidelity.measure("t", fmt.MXFP4, scheme, x, s.dequantize(plain), (1, 32))
    assert want.changed and want.groups_changed
    call = native.mx_int4_search
    for simd in (True, False):
        for n in (1, 2, 3):

            def pinned(*a, simd=simd, n=n, **k):
                return call(*a, **{**k, "simd": simd, "nthreads": n})

            monkeypatch.setattr(native, "mx_int4_search", pinned)
            stats: dict = {}
            parts = fp4_requant.requantize(p, s, stats=stats)
            assert all(torch.equal(v, plain[k]) for k, v in parts.items()), (simd, n)
            got = fidelity.from_sums("t", fmt.MXFP4, scheme, (96, 1024), (1, 32), stats["loss"])
            assert (got.changed, got.groups_changed, got.groups, got.max_abs_err) == (
                want.changed,
                want.groups_changed,
                want.groups,
                want.max_abs_err,
            ), (simd, n)
            assert got.rel_err == pytest.approx(want.rel_err, rel=1e-12)


def test_fp8_block_transcode_says_when_it_is_exact(path):
    """The FP8 transcode reports itself exact from its block keys (no comparison run)
    exactly when every value is held; a group 28 binades down is not."""
    s = get_scheme("fp8-block")
    p = _release(256, 384, seed=4)
    for deep in (False, True):
        if deep:
            p["weight_scale"][5, 0] = int(p["weight_scale"].max()) - 28
            p["weight_packed"][5, :16] = 0x77
        stats: dict = {}
        out = fp4_requant.requantize(p, s, name="t", stats=stats)
        held = fidelity.measure("t", fmt.MXFP4, "fp8-block", _decode(p), s.dequantize(out),
                                (1, 32)).exact  # fmt: skip
        assert stats.get("exact", False) == held == (not deep)


def test_int4_search_within_5_percent_of_exhaustive():
    """On a K3-shaped slice, int4 g32 with the search: relative MSE within 1.05x of the
    best bfloat16 scale per group among all of them between amax / 10 and amax / 4, and
    well below minmax's."""
    p = _release(256, 2048, seed=11)
    x = _decode(p)
    ref = x.double().square().sum()
    s = _search("int4-g32")
    mine = float(
        (s.dequantize(fp4_requant.requantize(p, s)).double() - x.double()).square().sum() / ref
    )
    mm = get_scheme("int4-g32")
    minmax = float((mm.dequantize(mm.quantize(x)).double() - x.double()).square().sum() / ref)
    g = x.view(-1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    lo, hi = torch.tensor(0.1).to(torch.bfloat16), torch.tensor(0.25).to(torch.bfloat16)
    ratios = torch.arange(int(lo.view(torch.int16)), int(hi.view(torch.int16)) + 1,
                          dtype=torch.int16).view(torch.bfloat16).float()  # fmt: skip
    best = None
    for r in ratios:  # every bfloat16 ratio: scales amax * r rounded to bfloat16
        sc = (amax * r).to(torch.bfloat16).clamp(min=torch.finfo(torch.bfloat16).tiny)
        q = torch.round((g / sc.float()).clamp(-8, 7))
        e = ((q.to(torch.bfloat16) * sc).double() - g.double()).square().sum(-1)
        best = e if best is None else torch.minimum(best, e)
    exhaustive = float(best.sum() / ref)
    assert len(ratios) > 100
    assert mine <= 1.05 * exhaustive, (mine, exhaustive)
    assert mine < minmax / 1.4, (mine, minmax)


def test_int4_search_declines_what_it_cannot_do(path):
    """An E8M0 code of a nonzero group outside the search's range: None (the float path);
    zero groups may carry any code."""
    s = _search("int4-g32")
    p = _release(16, 256)
    p["weight_scale"][1, :2] = 0  # the zero groups of row 1: any code is fine
    assert fp4_requant.requantize(p, s) is not None
    p["weight_scale"][0, 0] = 250
    assert fp4_requant.requantize(p, s) is None


def test_native_search_refuses_bad_arguments():
    if not HAVE_CC:
        pytest.skip("no C compiler")
    p = _release(8, 256)
    err = mx_int4._byte_errors(torch.bfloat16, -8, 7, 0)
    rel, _, nib, _ = mx_int4._tables(torch.bfloat16, -8, 7, 0)
    vals = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
    args = (p["weight_packed"], p["weight_scale"], 1, 0, err, nib, rel, vals, 1e-38, 0x88)
    assert native.mx_int4_search(*args, (16, 240)) is not None
    bad = [
        dict(sub=5),
        dict(depth=1),
        dict(err=err.to(torch.int64)),
        dict(err=err * 64),
        dict(nib=nib[:, :3]),
        dict(rel=rel[:3]),
        dict(code_range=(0, 255)),
        dict(zero_byte=256),
        dict(vals=vals[:4]),
    ]
    for change in bad:
        a = dict(zip(["packed", "codes", "sub", "depth", "err", "nib", "rel", "vals",
                      "zero_scale", "zero_byte"], args, strict=True))  # fmt: skip
        a["code_range"] = (16, 240)
        a.update(change)
        with pytest.raises(ValueError):
            native.mx_int4_search(a["packed"], a["codes"], a["sub"], a["depth"], a["err"],
                                  a["nib"], a["rel"], a["vals"], a["zero_scale"],
                                  a["zero_byte"], a["code_range"])  # fmt: skip


# -- the loss report ------------------------------------------------------------------------
def test_measure_counts_values_groups_and_error():
    src = torch.zeros(4, 64)
    src[0, 0], src[2, 40] = 2.0, -1.0
    out = src.clone()
    out[2, 40] = -1.5
    out[3, 63] = 0.25
    e = fidelity.measure("w", fmt.MXFP4, "int4-g32", src, out, (1, 32))
    assert (e.values, e.changed, e.groups, e.groups_changed) == (256, 2, 8, 2)
    assert e.rel_err == pytest.approx((0.25 + 0.0625) / 5.0) and e.max_abs_err == 0.5
    assert fidelity.measure("w", "x", "y", src, src.clone(), (128, 128)).exact
    rep = fidelity.LossReport([e, fidelity.exact("a", fmt.MXFP4, "nvfp4a16", (4, 64), (1, 32))])
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["tensors"] == 2 and doc["exact"] == 1 and doc["worst"] == ["w"]
    assert fidelity.LossReport.from_json(doc).to_json() == doc
    assert "1 of 2 tensors" in rep.summary() and "w (rel err" in rep.summary()


def test_loss_report_is_strict_json(tmp_path):
    """transcode_report.json never holds a NaN / Infinity literal: a non-finite error is
    null, and reads back as infinite."""
    src, out = torch.zeros(2, 32), torch.zeros(2, 32)
    out[0, 0] = 1.0
    e = fidelity.measure("w", fmt.MXFP4, "int4-g32", src, out, (1, 32))
    assert e.rel_err == float("inf")
    rep = fidelity.LossReport([e])
    rep.write(tmp_path / fidelity.FILE)

    def refuse(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    doc = json.loads((tmp_path / fidelity.FILE).read_text(), parse_constant=refuse)
    assert doc["entries"][0]["rel_err"] is None and doc["entries"][0]["max_abs_err"] == 1.0
    assert fidelity.LossReport.from_json(doc).entries[0].rel_err == float("inf")


def test_convert_and_verify_state_the_loss_report(tmp_path):
    """convert's report.json, its summary and HTML carry the loss report; shard carries the
    file into the stream and verify states it (a K3 whose experts go to NVFP4: exact)."""
    from k3convert.cli import main

    src, out, html = tmp_path / "k3", tmp_path / "cv", tmp_path / "cv.html"
    assert main(["synth", "kimi-k3", str(src), "--tiny"]) == 0
    recipe = RECIPES / "kimi-k3-nvfp4-experts.yaml"
    assert main(["convert", str(src), str(out), "--recipe", str(recipe),
                 "--set", "layout.tp=2", "--set", "layout.moe_ep=2", "--set",
                 "verify.enabled=false", "--report-html", str(html)]) == 0  # fmt: skip
    rep = json.loads((out / "report.json").read_text())["fidelity"]
    assert rep["tensors"] == rep["exact"] > 0 and rep["values_changed"] == 0
    assert rep["summary"].endswith("hold every released value (bit-exact)")
    assert json.loads((out / fidelity.FILE).read_text())["tensors"] == rep["tensors"]
    assert "Fidelity to the release" in html.read_text()
    vjson = tmp_path / "v.json"
    assert main(["verify", str(out), "--reference", str(src), "--json", str(vjson)]) == 0
    v = json.loads(vjson.read_text())["fidelity"]
    assert v["tensors"] == v["exact"] == rep["tensors"] and v["worst"] == []


def test_resumed_convert_says_what_it_did_not_measure(tmp_path, monkeypatch):
    """A convert resumed after an interruption re-encodes only the units it writes: the
    report lists the re-encoded tensors it did not measure and says so."""
    from k3convert.cli import main
    from k3convert.pipeline.convert import convert
    from k3convert.recipe import load_recipe
    from tests.test_convert import _interrupt_after, _Stop

    src, out = tmp_path / "k3", tmp_path / "cv"
    assert main(["synth", "kimi-k3", str(src), "--tiny"]) == 0
    recipe = load_recipe(RECIPES / "kimi-k3-nvfp4-experts.yaml",
                         ["layout.tp=2", "layout.moe_ep=2", "verify.enabled=false"])  # fmt: skip
    full = convert(src=src, out=tmp_path / "full", recipe=recipe, progress=False)
    total = full.report["fidelity"]["tensors"]
    assert total > 0 and not full.report["fidelity"]["unmeasured"]
    _interrupt_after(monkeypatch, 13)
    with pytest.raises(_Stop):
        convert(src=src, out=out, recipe=recipe, progress=False)
    monkeypatch.undo()
    res = convert(src=src, out=out, recipe=recipe, progress=False)
    f = res.report["fidelity"]
    assert res.units_skipped == 13 and f["unmeasured"]
    assert f["tensors"] + len(f["unmeasured"]) == total
    assert "not measured" in f["summary"]
    doc = json.loads((out / fidelity.FILE).read_text())
    assert fidelity.LossReport.from_json(doc).unmeasured == f["unmeasured"]


@pytest.mark.parametrize("name", ["fp8-block", "int4-g32", "w4a16"])
def test_transcodes_read_back_by_compressed_tensors(name):
    """compressed-tensors' own decompressors read the transcoded parts: FP8 blocks give
    the release's values exactly, the searched int4 what k3convert's loss report measured
    (its dequantization)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme

    s = get_scheme(name) if name.startswith("fp8") else _search(name)
    p = _release(256, 512, seed=4)
    parts = fp4_requant.requantize(p, s, name="t")
    scheme = QuantizationScheme.model_validate(s.ct_scheme(["Linear"]))
    comp = BaseCompressor.get_value_from_registry(infer_module_format(torch.nn.Linear,
                                                                      scheme).value)  # fmt: skip
    ct = comp.decompress(dict(parts), scheme)["weight"].float()
    assert torch.equal(ct, s.dequantize(parts))
    if name.startswith("fp8"):
        assert torch.equal(ct, _decode(p))
