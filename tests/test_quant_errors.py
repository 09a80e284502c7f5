"""Bad input gives a clear K3Error before anything lands in OUT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3convert.errors import CheckpointError, ConfigError, K3Error, OutputError
from k3convert.pipeline import quantize
from k3convert.quant import GroupSizeError, NonFiniteWeightError, UnknownSchemeError

SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.models import save_model

    return save_model("llama", tmp_path_factory.mktemp("llama") / "m", **SMALL)


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.partial")]


def test_group_size_not_dividing_names_tensor(tiny_models, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(GroupSizeError) as e:  # hidden 64: g128 cannot divide
        quantize(src=tiny_models["llama"], out=out, scheme="w4a16", progress=False)
    msg = str(e.value)
    assert "group size 128" in msg and "input dimension 64" in msg
    assert "model.layers.0.mlp.gate_proj.weight" in msg  # the first, then a count
    assert "more tensor(s) have the same problem" in msg
    assert not out.exists() and not _leftovers(tmp_path, "out")


def test_nan_in_source_names_tensor(llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        quantize(src=src, out=out, scheme="fp8-block", progress=False)
    assert not out.exists() and not _leftovers(tmp_path, "out")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = 0
    sd["model.norm.weight"][0] = float("inf")  # kept tensors are checked too
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        quantize(src=src, out=out, scheme="fp8-block", progress=False)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w2a16", "fp8-block-ue8m0"])
def test_huge_finite_weights_write_finite_scales(llama, tmp_path, scheme):
    """3e38 / -3e38 (finite) in a source weight: every scale and every value
    compressed-tensors dequantizes from OUT is finite."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from k3convert.checkpoint import open_checkpoint

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    sd = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name][3, 5], sd[name][3, 6], sd[name][40, 0] = 3e38, -3e38, -3.3e38
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    res = quantize(src=src, out=out, scheme=scheme, progress=False)
    ck = open_checkpoint(out)
    for r in res.plan.quantized:
        parts = ck.get_parts(r.name)
        assert torch.isfinite(parts["weight_scale"].float()).all(), r.name
        ct_scheme = QuantizationScheme.model_validate(r.scheme.ct_scheme(["Linear"]))
        comp = BaseCompressor.get_value_from_registry(r.scheme.format)
        ct = comp.decompress(dict(parts), ct_scheme)["weight"].float()
        assert torch.isfinite(ct).all(), r.name
        assert torch.equal(ct, r.scheme.dequantize(parts)), r.name
    w, s_w = ck.get(name), load_file(src / "model.safetensors")[name]
    bits = getattr(res.plan.quantized[0].scheme, "num_bits", None)
    step = 0.07 if bits is None else 2 / (2**bits - 1)  # one quantization step of amax
    for i, j in [(3, 5), (3, 6), (40, 0)]:
        assert abs(float(w[i, j]) - float(s_w[i, j])) <= step * 3.3e38, (i, j)


def test_unrepresentable_weight_refused_with_name(llama, tmp_path):
    from k3convert.quant import WeightRangeError
    from k3convert.recipe import parse_recipe

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.self_attn.o_proj.weight"][1, 2] = 1e6
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    recipe = parse_recipe(
        {"quantize": {"rules": [{"scheme": "w4a16", "options": {"scale_dtype": "float16"}}]}}
    )
    out = tmp_path / "out"
    with pytest.raises(WeightRangeError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight'"):
        quantize(src=src, out=out, recipe=recipe, progress=False)
    assert not out.exists() and not _leftovers(tmp_path, "out")


def test_non_finite_input_scale_is_never_written(llama, tmp_path):
    from k3convert.pipeline import plan_quantization

    _, plan = plan_quantization(src=llama, scheme="fp8")
    scales = {r.module: 0.01 for r in plan.quantized}
    bad = "model.layers.1.self_attn.k_proj"
    scales[bad] = float("inf")
    out = tmp_path / "out"
    with pytest.raises(NonFiniteWeightError, match=rf"'{bad}\.input_scale'"):
        quantize(src=llama, out=out, scheme="fp8", input_scales=scales, progress=False)
    assert not out.exists() and not _leftovers(tmp_path, "out")


def test_unknown_scheme(llama, tmp_path):
    with pytest.raises(UnknownSchemeError, match=r"Known schemes: .*fp8-block.*w4a16"):
        quantize(src=llama, out=tmp_path / "o", scheme="int5-magic", progress=False)


def test_out_exists_and_force(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a previous output: --force may replace it
    (out / "marker").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        quantize(src=llama, out=out, scheme="fp8-dynamic", progress=False)
    assert (out / "marker").exists()
    res = quantize(src=llama, out=out, scheme="fp8-dynamic", force=True, progress=False)
    assert not (out / "marker").exists() and (out / "config.json").exists()
    assert (out / "model.safetensors").exists()  # one file: no index, as transformers writes
    assert not (out / "model.safetensors.index.json").exists()
    assert "wrote" in res.summary()


def test_not_enough_disk(llama, tmp_path, monkeypatch):
    import k3convert.checkpoint.output as output

    monkeypatch.setattr(output, "free_bytes", lambda p: 1000)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="GiB is free"):
        quantize(src=llama, out=out, scheme="w8a8", progress=False)
    assert not out.exists() and not _leftovers(tmp_path, "out")


def test_scheme_xor_recipe(llama, tmp_path):
    with pytest.raises(ConfigError, match="exactly one"):
        quantize(src=llama, out=tmp_path / "o", progress=False)
    with pytest.raises(ConfigError, match="exactly one"):
        quantize(src=llama, out=tmp_path / "o", scheme="w8a8", recipe="x.yaml", progress=False)


def test_static_fp8_needs_calibrated_scales(llama, tmp_path):
    with pytest.raises(ConfigError, match="calibration"):
        quantize(src=llama, out=tmp_path / "o", scheme="fp8", progress=False)
    from k3convert.pipeline import plan_quantization

    _, plan = plan_quantization(src=llama, scheme="fp8")
    scales = {r.module: 0.01 for r in plan.quantized}
    out = tmp_path / "o"
    quantize(src=llama, out=out, scheme="fp8", input_scales=scales, progress=False)
    from k3convert.checkpoint import open_checkpoint

    ck = open_checkpoint(out)
    parts = ck.get_parts("model.layers.0.self_attn.q_proj.weight")
    assert float(parts["input_scale"]) == pytest.approx(0.01)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ia = qc["config_groups"]["group_0"]["input_activations"]
    assert ia["dynamic"] is False and ia["strategy"] == "tensor"


def test_workers_and_shards_give_identical_output(llama, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    quantize(src=llama, out=a, scheme="w4a16", progress=False)
    quantize(src=llama, out=b, scheme="w4a16", workers=2, shard_size=200_000, progress=False)
    assert not (a / "model.safetensors.index.json").exists()
    ib = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(ib.values())) > 1
    ta = load_file(a / "model.safetensors")
    assert set(ta) == set(ib)
    tb = {}
    for f in set(ib.values()):
        tb.update(load_file(b / f))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_errors_are_k3errors():
    for cls in (GroupSizeError, NonFiniteWeightError, UnknownSchemeError):
        assert issubclass(cls, K3Error)
