"""The ``mse`` weight observer of integer schemes (k3convert.quant.mse_observer).

Oracle: llm-compressor 0.14's own MSE grid search (``observers/mse_quant.py::
_grid_search_mse``: compressed-tensors' ``calculate_qparams`` + ``fake_quantize`` per
candidate range), run on the same float32 weight with its early stop disabled: the
scales we store are the ones its chosen ranges give, except where two candidates' errors
tie to float32 rounding (their sums run in another order), and there our choice is no
worse by more than that rounding. Then: the chosen parts are never worse than round to
nearest on any group, are bit-identical to it when nothing may shrink, are an ordinary
compressed-tensors checkpoint (its decompressor gives our dequantize), and every bad
option is a clear error (exit 2 from the CLI).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from functools import cache
from pathlib import Path

import pytest
import torch

from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.quant import mse_observer
from k3convert.quant.schemes import get_scheme
from tests.moonshot_oracle import temporary_modules

SCHEMES = ["w4a16", "w4a16-asym", "int3-g64", "int8-g128-asym", "w8a8", "int4-g32"]


@cache
def llmc_grid_search():
    """llm-compressor's ``_grid_search_mse`` (its package imported without its
    dependencies: only the observer files, beside stand-ins for their parents)."""
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the oracle needs: pip install --no-deps llmcompressor==0.14.0.1")
    root = Path(next(iter(spec.submodule_search_locations)))
    stand_ins = {}
    for n in ("llmcompressor", "llmcompressor.observers", "llmcompressor.utils"):
        m = types.ModuleType(n)
        m.__path__ = []
        stand_ins[n] = m
    base = types.ModuleType("llmcompressor.observers.base")
    base.MinMaxTuple = tuple
    stand_ins["llmcompressor.observers.base"] = base
    names = ["llmcompressor.utils.triton_utils", "llmcompressor.observers.mse_quant"]
    files = ("utils/triton_utils.py", "observers/mse_quant.py")
    with temporary_modules(stand_ins, also=names):
        for full, file in zip(names, files, strict=True):
            s = importlib.util.spec_from_file_location(full, root / file)
            m = importlib.util.module_from_spec(s)
            sys.modules[full] = m
            s.loader.exec_module(m)
        return m._grid_search_mse


def _weight(out=96, inp=256, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    # heavy tails: a few outliers per row decide the minmax step of their group
    w += (torch.rand(out, inp, generator=g) < 0.01) * torch.randn(out, inp, generator=g) * 0.1
    return w.to(dtype)


def _group_loss(scheme, w, parts, norm) -> torch.Tensor:
    """sum |w - dq| ** norm per group [out, ng], float64."""
    out, inp = w.shape
    ng = parts["weight_scale"].shape[1]
    d = (scheme.dequantize(parts).double() - w.double()).abs().pow(norm)
    return d.view(out, ng, inp // ng).sum(-1)


def _ct_args(scheme):
    from compressed_tensors.quantization import QuantizationArgs

    a = scheme.weight_args()
    return QuantizationArgs(num_bits=a["num_bits"], type="int", symmetric=a["symmetric"],
                            strategy=a["strategy"], group_size=a["group_size"],
                            scale_dtype=scheme.sdtype)  # fmt: skip


@pytest.mark.parametrize("name", SCHEMES)
def test_matches_llm_compressor_mse_observer(name):
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    search = llmc_grid_search()
    # float32 scales: llm-compressor dequantizes a float32 weight's candidates in float32,
    # we in the scale's dtype (as loaders do), so the two are the same products only there
    scheme = get_scheme(name, observer="mse", scale_dtype="float32")
    w = _weight()
    out, inp = w.shape
    ng = scheme.ngroups(inp)
    args = _ct_args(scheme)
    token = args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})
    obs = w.view(1, out, ng, inp // ng)  # (observations, *qparams shape, group)
    lo, hi = search(obs, args, token, scheme.mse_maxshrink, 10**6, float(scheme.mse_grid),
                    scheme.mse_norm, 0.3)  # fmt: skip
    their_scale, their_zp = calculate_qparams(lo, hi, args)
    parts = scheme.quantize(w)
    ours = parts["weight_scale"]
    same = ours == their_scale.to(ours.dtype)
    assert float(same.float().mean()) >= 0.97, float(same.float().mean())
    # where the scales differ, the candidates tied: our loss is within float32 rounding
    # of the loss under their choice (both computed here, in float64)
    mine = _group_loss(scheme, w, parts, scheme.mse_norm)
    zp = None if scheme.symmetric else their_zp.float()
    alt = _loss_under(scheme, w, their_scale.to(ours.dtype), zp, scheme.mse_norm)
    assert bool((mine <= alt * (1 + 1e-4)).all())


def _loss_under(scheme, w, scale, zp, norm) -> torch.Tensor:
    """Round to nearest of ``w`` under the scales / zero points given (compressed-tensors'
    formulas), its loss per group as :func:`_group_loss`."""
    out, inp = w.shape
    g = w.view(out, scale.shape[1], -1)
    x = g / scale.float()[..., None]
    if zp is not None:
        x = x + zp[..., None]
    q = torch.round(x.clamp(scheme.qmin, scheme.qmax)).to(scale.dtype)
    if zp is not None:
        q = q - zp.to(scale.dtype)[..., None]
    deq = (q * scale[..., None]).view(out, inp).double()
    return (deq - w.double()).abs().pow(norm).view(out, scale.shape[1], -1).sum(-1)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_worse_than_round_to_nearest_per_group(name, dtype):
    plain, mse = get_scheme(name), get_scheme(name, observer="mse")
    w = _weight(seed=1, dtype=dtype)
    a, b = plain.quantize(w), mse.quantize(w)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {
        k: (v.dtype, v.shape) for k, v in b.items()
    }
    la, lb = _group_loss(plain, w, a, mse.mse_norm), _group_loss(mse, w, b, mse.mse_norm)
    # never worse (float32 rounding of the search's own sums: 1e-5), much better in total
    assert bool((lb <= la * (1 + 1e-5)).all())
    assert float(lb.sum()) < float(la.sum())
    if mse.num_bits <= 4:  # a coarse grid: clipping pays off by more than 5 %
        assert float(lb.sum()) < 0.95 * float(la.sum())


@pytest.mark.parametrize("name", SCHEMES)
def test_no_shrink_is_round_to_nearest_bit_for_bit(name):
    w = _weight(seed=2, dtype=torch.bfloat16)
    a = get_scheme(name).quantize(w)
    b = get_scheme(name, observer="mse", mse_maxshrink=0.0).quantize(w)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_candidates_are_llm_compressors_grid():
    assert mse_observer.candidates(100, 0.2) == [1 - i / 100 for i in range(20)]
    assert mse_observer.candidates(10, 0.0) == [1.0]
    assert len(mse_observer.candidates(500, 0.2)) == 100


@pytest.mark.parametrize(
    "opts, msg",
    [
        ({"observer": "kl"}, "weight observer must be minmax or mse"),
        ({"observer": "mse", "mse_grid": 0}, "mse_grid must be a positive integer"),
        ({"observer": "mse", "mse_maxshrink": 1.0}, "mse_maxshrink must be a number"),
        ({"observer": "mse", "mse_norm": True}, "mse_norm must be a number"),
    ],
)
def test_bad_options_are_config_errors(opts, msg):
    with pytest.raises(ConfigError, match=msg):
        get_scheme("w4a16", **opts)


def _tiny(tmp_path) -> Path:
    from tests.models import save_model

    return save_model("llama", tmp_path / "src")


def test_cli_mse_checkpoint_is_compressed_tensors_and_recorded(tmp_path):
    """``--weight-observer mse``: config.json records the observer as llm-compressor does,
    compressed-tensors parses it, and its decompressor gives our dequantized weights."""
    from compressed_tensors.quantization import QuantizationConfig

    from k3convert.checkpoint import open_checkpoint
    from tests.test_quant_oracle import _dequantizer_dense

    src, out, ref = _tiny(tmp_path), tmp_path / "out", tmp_path / "ref"
    assert main(["quantize", str(src), str(out), "--scheme", "int4-g32",
                 "--weight-observer", "mse"]) == 0  # fmt: skip
    assert main(["quantize", str(src), str(ref), "--scheme", "int4-g32"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    wargs = next(iter(qc["config_groups"].values()))["weights"]
    assert wargs["observer"] == "mse"
    assert wargs["observer_kwargs"] == {"grid": 100, "maxshrink": 0.2, "norm": 2.4}
    assert QuantizationConfig.model_validate(qc).config_groups
    ck, rk, sk = open_checkpoint(out), open_checkpoint(ref), open_checkpoint(src)
    _dequantizer_dense(out, tmp_path / "dense", ck)  # compressed-tensors' decompressor
    dense = open_checkpoint(tmp_path / "dense")
    scheme = get_scheme("int4-g32", observer="mse")
    moved = 0
    for n in ck.names():
        if ck.meta(n).encoding == "plain":
            continue
        mine = scheme.dequantize(ck.get_parts(n))  # (q - zp) * scale in bf16, as ct
        assert torch.equal(dense.get(n, torch.float32), mine), n
        # our reader multiplies in float32: one rounding of the same product in bf16
        assert torch.equal(ck.get(n, torch.bfloat16), mine.to(torch.bfloat16)), n
        w = sk.get(n, torch.float32)
        e_mse = float((mine - w).abs().pow(2.4).sum())
        e_rtn = float((rk.get(n, torch.float32) - w).abs().pow(2.4).sum())
        assert e_mse <= e_rtn * (1 + 1e-5), n
        moved += e_mse < e_rtn
    assert moved, "the search changed no tensor"


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--scheme", "int4-g32", "--weight-observer", "kl"], "must be minmax or mse"),
        (["--scheme", "fp8-dynamic", "--weight-observer", "mse"], "no tensor of this plan"),
    ],
)
def test_cli_bad_weight_observer_exits_2(tmp_path, capsys, argv, msg):
    src, out = _tiny(tmp_path), tmp_path / "out"
    assert main(["quantize", str(src), str(out), *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert msg in err and "Traceback" not in err, err
    assert not out.exists()


def test_recipe_rule_observer_option(tmp_path, capsys):
    """A recipe rule sets the observer in its options; a bad value is exit 2 naming it."""
    src = _tiny(tmp_path)
    good = tmp_path / "good.yaml"
    good.write_text("quantize:\n  rules:\n    - match: ['*mlp*']\n      scheme: int4-g32\n"
                    "      options: {observer: mse, mse_grid: 50}\n"
                    "    - match: ['*']\n      scheme: int4-g32\n")  # fmt: skip
    assert main(["quantize", str(src), str(tmp_path / "o"), "--recipe", str(good)]) == 0
    groups = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    obs = sorted(g["weights"]["observer"] for g in groups["config_groups"].values())
    assert obs == ["minmax", "mse"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantize:\n  rules:\n    - match: ['*']\n      scheme: int4-g32\n"
                   "      options: {observer: entropy}\n")  # fmt: skip
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "b"), "--recipe", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "bad.yaml: quantize.rules[0]: weight observer must be minmax or mse" in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", SCHEMES)
def test_fast_search_equals_the_exact_one(name):
    """The search computes each candidate's scale / zero point from the shrunk range
    alone; the exact path clamps the group and runs the scheme's own quantizer on it
    (with its checks). Same parts, bit for bit, on bf16 and float32 weights."""
    scheme = get_scheme(name, observer="mse")
    for dtype in (torch.bfloat16, torch.float32):
        w = _weight(seed=3, dtype=dtype)
        exact = scheme.quantize_general(
            w, "w", rows=lambda g, n: mse_observer._rows(scheme, g, n, exact=True)
        )
        fast = scheme.quantize(w)
        assert all(torch.equal(exact[k], fast[k]) for k in exact), (name, dtype)


def test_huge_and_non_finite_weights(monkeypatch):
    """A band whose range overflows the scale dtype takes the exact path (the scheme's
    fallbacks: finite parts); NaN is the scheme's NonFiniteWeightError naming the tensor."""
    from k3convert.quant.schemes import NonFiniteWeightError

    scheme = get_scheme("w4a16-asym", observer="mse", scale_dtype="float16")
    w = _weight(out=16, inp=256)
    w[3, 7], w[3, 8] = 6.0e4, -6.0e4  # (max - min) / 15 fits float16, 15 * scale does not
    calls = []
    exact = mse_observer._exact_candidate
    monkeypatch.setattr(mse_observer, "_exact_candidate", lambda *a: calls.append(1) or exact(*a))
    parts = scheme.quantize(w)
    assert calls, "the band did not take the exact path"
    assert bool(torch.isfinite(scheme.dequantize(parts)).all())
    w[5, 9] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=r"'blk\.w'"):
        scheme.quantize(w, name="blk.w")


def test_gram_search_identity_is_the_squared_error_search():
    """With identity Gram blocks the output error is the squared weight error: the same
    choice as the norm-2 search, bit for bit."""
    w = _weight(seed=4)
    scheme = get_scheme("w4a16-asym", observer="mse", mse_norm=2.0)
    ng = scheme.ngroups(w.shape[1])
    eye = torch.eye(128).expand(ng, 128, 128).contiguous()
    a = mse_observer.quantize(scheme, w, gram=eye)
    b = scheme.quantize(w)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gram_search_lowers_the_output_error():
    """On correlated, unequally scaled inputs, the ranges searched on d^T G d give a
    lower output error ||X (w - dq)^T||^2 than round to nearest on every group, and
    lower in total than the data-free search's."""
    from tests.test_gptq import correlated_inputs

    w = _weight(out=64, inp=256, seed=5)
    x = correlated_inputs(1024, 256, seed=5)
    acc = mse_observer.GroupGram(256, 128)
    for b in x.split(256):
        acc.add(b.view(2, 128, 256))
    assert acc.tokens == 1024
    plain, mse = get_scheme("w4a16"), get_scheme("w4a16", observer="mse")
    parts = {"rtn": plain.quantize(w), "mse": mse.quantize(w),
             "gram": mse_observer.quantize(plain, w, gram=acc.blocks())}  # fmt: skip

    def out_err(p):  # per group: sum over tokens of (x_g . d_g)^2
        d = (plain.dequantize(p) - w).view(64, 2, 128)
        xg = x.view(1024, 2, 128)
        return torch.einsum("tgi,ogi->tog", xg.double(), d.double()).pow(2).sum(0).t()

    e = {k: out_err(v) for k, v in parts.items()}
    assert bool((e["gram"] <= e["rtn"] * (1 + 1e-4)).all())
    assert float(e["gram"].sum()) < 0.9 * float(e["mse"].sum()), {
        k: float(v.sum()) for k, v in e.items()
    }
