"""fake_quant_activation == compressed-tensors' forward_quantize, bit for bit."""

from __future__ import annotations

import pytest
import torch

from k3convert.quant import ActivationSpec, activation_spec_for, fake_quant_activation, get_scheme


def _ct(x, spec: ActivationSpec):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    args = QuantizationArgs.model_validate(spec.ct_args())
    m = torch.nn.Module()
    m.quantization_status = QuantizationStatus.FROZEN
    if not spec.dynamic:
        m.input_scale = spec.scale
        m.input_zero_point = (
            spec.zero_point if spec.zero_point is not None else torch.zeros_like(spec.scale)
        )
    return forward_quantize(m, x, "input", args)


SPECS = {
    "fp8-token": ActivationSpec(8, "float", "token"),
    "int8-token": ActivationSpec(8, "int", "token"),
    "int8-token-asym": ActivationSpec(8, "int", "token", symmetric=False),
    "fp8-group128": ActivationSpec(8, "float", "group", group_size=128),
    "fp8-tensor-dyn": ActivationSpec(8, "float", "tensor"),
    "fp8-static": ActivationSpec(8, "float", "tensor", dynamic=False).with_scale(
        torch.tensor([0.02])
    ),
    "int8-static": ActivationSpec(8, "int", "tensor", dynamic=False).with_scale(
        torch.tensor([0.015])
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 256), (7, 256), (1, 1, 3, 256)])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_compressed_tensors(name, shape, dtype):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    x.view(-1, shape[-1])[0, 3] = 40.0  # an outlier
    if len(shape) > 2:
        x[0, 0] = 0  # an all-zero token (zero scale -> eps)
    if spec.scale is not None:
        spec = spec.with_scale(spec.scale.to(dtype))
    ours = fake_quant_activation(x, spec)
    theirs = _ct(x, spec)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    assert torch.isfinite(ours).all()


def test_token_strategy_quirk_on_2d_inputs():
    """compressed-tensors reduces over dims >= 2 only: a 2-D input gets one scale."""
    x = torch.tensor([[1.0, 0.001], [100.0, 0.5]])
    spec = SPECS["int8-token"]
    y2 = fake_quant_activation(x, spec)
    y3 = fake_quant_activation(x[None], spec)[0]
    assert not torch.equal(y2, y3)
    assert y2[0, 1] == 0  # the shared scale (100/127.5) flushes 0.001 to 0


def test_none_spec_is_identity():
    x = torch.randn(3, 4)
    assert fake_quant_activation(x, None) is x


def test_static_without_scale_is_an_error():
    with pytest.raises(Exception, match="input_scale"):
        fake_quant_activation(torch.randn(2, 4), ActivationSpec(8, "float", "tensor", False))


def test_activation_spec_for_configs():
    cfg = {"quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": get_scheme("fp8-block").ct_scheme(["re:.*self_attn.*"]),
            "group_1": get_scheme("w4a16").ct_scheme(["re:.*experts.*"]),
            "group_2": get_scheme("w8a8").ct_scheme(["model.layers.0.mlp.down_proj"]),
            "group_3": get_scheme("fp8").ct_scheme(["Linear"]),
        },
        "ignore": ["lm_head", "re:.*mlp\\.gate$"],
    }}  # fmt: skip
    s = activation_spec_for(cfg, "model.layers.3.self_attn.q_a_proj.weight")
    assert s == ActivationSpec(8, "float", "group", group_size=128)
    assert activation_spec_for(cfg, "model.layers.3.mlp.experts.7.up_proj.weight") is None
    s = activation_spec_for(cfg, "model.layers.0.mlp.down_proj.weight")
    assert s == ActivationSpec(8, "int", "token")  # exact name beats everything
    assert activation_spec_for(cfg, "lm_head.weight") is None
    assert activation_spec_for(cfg, "model.layers.3.mlp.gate.weight") is None
    s = activation_spec_for(cfg, "model.layers.1.mlp.up_proj.weight", torch.tensor([0.5]))
    assert not s.dynamic and float(s.scale) == 0.5  # falls back to the Linear group
    assert activation_spec_for({"model_type": "llama"}, "model.layers.0.mlp.up_proj.weight") is None
    # it reads the quantization_config block itself too
    assert activation_spec_for(cfg["quantization_config"], "lm_head.weight") is None


def test_activation_spec_for_our_output(tmp_path):
    import json

    from tests.models import save_model

    src = save_model("llama", tmp_path / "m", hidden_size=128, intermediate_size=256)
    from k3convert.pipeline import quantize

    quantize(src=src, out=tmp_path / "o", scheme="fp8-block", progress=False)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    s = activation_spec_for(cfg, "model.layers.1.self_attn.o_proj.weight")
    assert s is not None and s.strategy == "group" and s.group_size == 128
    assert activation_spec_for(cfg, "lm_head.weight") is None
