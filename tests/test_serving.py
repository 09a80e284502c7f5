"""The serving check (k3convert.serving): each vLLM load-time rule, on tiny synthetic
models, and its CLI (warnings; --strict-serving: one line, exit 2, nothing written).

Which rules are vLLM's own is tested against the real engine in tests/test_vllm.py (vLLM
refuses what this check flags and loads what it passes); here every rule that can fail
is made to fail, and to pass one tp or device away.
"""

from __future__ import annotations

import json

import pytest

from k3convert.cli import main
from k3convert.pipeline.quantize import plan_quantization
from k3convert.serving import KERNELS, ServingError, ServingTarget, check_plan, kernel_class
from tests.models import QUANT_FAMILIES

#: llama whose k_proj / v_proj have 64 rows (2 KV heads x 32) and whose MLP is 384 wide,
#: the shape of the trained fixture
SMALL = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
#: the same with 128-row k_proj / v_proj (4 KV heads x 32)
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4)  # fmt: skip


def _problems(src, scheme, keep=(), **kw):
    ck, plan = plan_quantization(src=src, scheme=scheme, keep=keep)
    return check_plan(plan, ck.config, **kw)


def _leaves(problems) -> set[str]:
    return {p.tensor.rsplit(".", 2)[-2] for p in problems}


def test_every_registered_scheme_has_a_kernel_row():
    from k3convert.quant.schemes import get_scheme, known_schemes

    for name in known_schemes():
        row = KERNELS[kernel_class(get_scheme(name))]
        assert set(row) == {"vllm-cuda", "vllm-cpu"}, name


def test_fp8_block_output_rows(model_factory):
    src = model_factory("llama", **SMALL)
    ps = _problems(src, "fp8-block")
    # q/k/v fuse into one GEMM: vLLM checks every member but the last (v_proj) at tp 1
    assert _leaves(ps) == {"k_proj"}
    (p,) = ps
    assert p.count == 2 and p.shape == (64, 128) and "block_n" in p.rule
    assert "fp8-dynamic" in p.fix
    # split by KV heads at tp 2: each rank's k_proj and v_proj slice is 32 rows
    assert _leaves(_problems(src, "fp8-block", tp=2)) >= {"k_proj", "v_proj"}
    assert _problems(model_factory("llama", **WIDE), "fp8-block") == []


def test_fp8_block_input_columns_of_row_parallel_slices(model_factory):
    src = model_factory("llama", **WIDE)
    ps = _problems(src, "fp8-block", tp=4)  # o_proj: 128 / 4 = 32 input columns each
    bad = {p.tensor.rsplit(".", 2)[-2]: p for p in ps}
    assert "o_proj" in bad and "block_k" in bad["o_proj"].rule
    assert "input slice 32 is not a multiple of the block's 128" in bad["o_proj"].rule
    assert bad["o_proj"].tp == 4


def test_int_group_must_divide_the_tp_slice(model_factory):
    src = model_factory("llama", **SMALL)
    assert _problems(src, "w4a16") == []
    ps = {p.tensor.rsplit(".", 2)[-2]: p for p in _problems(src, "w4a16", tp=2)}
    assert set(ps) == {"down_proj", "o_proj"}  # 384 / 2 = 192 and 128 / 2 = 64 columns
    assert "input slice 192 is not a multiple of the group size 128" in ps["down_proj"].rule
    assert ps["down_proj"].tp == 2
    assert "group_size 64" in ps["down_proj"].fix
    assert _problems(src, "int4-g64", tp=2) == []


def test_fused_members_need_one_scheme(model_factory):
    src = model_factory("llama", **WIDE)
    ps = _problems(src, "fp8-dynamic", keep=("re:.*k_proj.*",))
    assert len(ps) == 1 and "one scheme" in ps[0].rule and ps[0].count == 2
    assert _problems(src, "fp8-dynamic", keep=("re:.*_proj.*",)) == []


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4", "mxfp4", "w3a16", "fp8-channel"])
def test_no_cpu_kernel(model_factory, scheme):
    src = model_factory("llama", **WIDE)
    (p,) = _problems(src, scheme, device="cpu")  # one line for the scheme, not per tensor
    assert "no kernel" in p.rule and p.count > 1
    assert _problems(src, scheme, device="cuda") == []


def test_no_kernel_on_any_device(model_factory):
    src = model_factory("llama", **WIDE)
    for device in ("cuda", "cpu"):
        (p,) = _problems(src, "w8a8-g128", device=device)
        assert "int8-group-w8a8" in p.rule


def test_moe_experts_have_no_cpu_backend(model_factory):
    src = model_factory("qwen3_moe", **QUANT_FAMILIES["qwen3_moe"])
    for scheme in ("fp8-dynamic", "w8a8", "w4a16"):
        ps = _problems(src, scheme, device="cpu")
        assert len(ps) == 1 and "routed experts" in ps[0].rule, scheme
        assert _problems(src, scheme, device="cuda") == [], scheme


def test_cpu_int4_needs_fused_outputs_of_32(model_factory):
    # MLA: q_a_proj (64) + kv_a_proj_with_mqa (32 + 8) fuse into 104 output rows
    kw = {**QUANT_FAMILIES["deepseek_v3"], "q_lora_rank": 64, "kv_lora_rank": 32,
          "qk_rope_head_dim": 8, "n_routed_experts": 0, "first_k_dense_replace": 99}  # fmt: skip
    src = model_factory("deepseek_v3", **kw)
    ps = [p for p in _problems(src, "int4-g32", device="cpu") if "fused output" in p.rule]
    assert _leaves(ps) == {"q_a_proj", "kv_a_proj_with_mqa"}
    assert "slice 104" in ps[0].rule
    assert _problems(src, "int4-g32", device="cuda") == []


def test_target_validation():
    with pytest.raises(ServingError.__mro__[1]):  # ConfigError
        ServingTarget(device="tpu")
    with pytest.raises(ServingError.__mro__[1]):
        ServingTarget(tp=0)


def test_quantize_warns_and_strict_refuses(model_factory, tmp_path, capsys):
    src = model_factory("llama", **SMALL)
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--scheme", "fp8-block", "--strict-serving"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --strict-serving: vllm-cuda")
    assert "k_proj" in err[0] and "Traceback" not in err[0]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    assert main(["quantize", str(src), str(out), "--scheme", "fp8-block"]) == 0
    err = capsys.readouterr().err
    assert "warning: serving: vllm-cuda will not load" in err and out.is_dir()
    assert main(["quantize", str(src), str(tmp_path / "o2"), "--scheme", "w4a16",
                 "--serving-tp", "2", "--serving-device", "cpu"]) == 0  # fmt: skip
    assert "group size" in capsys.readouterr().err


def test_plan_and_convert_strict(model_factory, tmp_path, capsys):
    src = model_factory("llama", **SMALL)
    assert main(["plan", str(src), "--scheme", "fp8-block", "--context", "1k"]) == 0
    assert "warning: serving: vllm-cuda will not load" in capsys.readouterr().out
    rc = main(["plan", str(src), "--scheme", "fp8-block", "--context", "1k", "--strict-serving"])
    assert rc == 2 and "--strict-serving" in capsys.readouterr().err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "version": 1, "quantize": {"rules": [{"roles": ["attention", "mlp"],
                                              "scheme": "fp8-block"}]},
        "output": {"strict_serving": True}, "verify": {"enabled": False},
    }))  # fmt: skip
    out = tmp_path / "stream"
    assert main(["convert", str(src), str(out), "-r", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--strict-serving" in err and not out.exists()
