"""Bad input gives a clear K3Error before anything lands in OUT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3convert.errors import CheckpointError, ConfigError, K3Error, OutputError
from k3convert.quant import GroupSizeError, NonFiniteWeightError, UnknownSchemeError, quantize

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


def test_unknown_scheme(llama, tmp_path):
    with pytest.raises(UnknownSchemeError, match=r"Known schemes: .*fp8-block.*w4a16"):
        quantize(src=llama, out=tmp_path / "o", scheme="int5-magic", progress=False)


def test_out_exists_and_force(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
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
    from k3convert.quant import plan_quantization

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
