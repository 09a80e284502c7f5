"""Rules, default exceptions, the resolved table, recipes, and the quantization_config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ConfigError
from k3convert.pipeline import plan_quantization, quantize
from k3convert.quant import get_scheme
from k3convert.recipe import load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DSV3_128 = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                kv_lora_rank=128, q_lora_rank=128, v_head_dim=32, qk_nope_head_dim=32,
                qk_rope_head_dim=16, num_nextn_predict_layers=0)  # fmt: skip


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    from tests.models import save_model

    return save_model("deepseek_v3", tmp_path_factory.mktemp("dsv3") / "m", **DSV3_128)


def _decisions(plan):
    return {r.name: r for r in plan.rows}


def test_default_exceptions_kept(dsv3):
    _, plan = plan_quantization(src=dsv3, scheme="fp8-block")
    d = _decisions(plan)
    kept = {n for n, r in d.items() if r.kept}
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.0.input_layernorm.weight",
              "model.layers.0.self_attn.kv_a_layernorm.weight"):  # fmt: skip
        assert n in kept, n
        assert "default exception" in d[n].reason
    for n in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.1.mlp.experts.3.up_proj.weight",
              "model.layers.1.mlp.shared_experts.gate_proj.weight"):  # fmt: skip
        assert d[n].scheme == get_scheme("fp8-block"), n
    table = plan.table()
    assert "model.layers.{N}.mlp.experts.{N}.up_proj.weight" in table
    assert "default exception (router: router)" in table
    full = plan.table(collapse=False)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in full


def test_keep_and_no_default_keep(dsv3):
    _, plan = plan_quantization(
        src=dsv3,
        scheme="fp8-block",
        keep=["*.self_attn.*", "re:.*layers\\.2\\.mlp\\.experts\\.0\\."],
    )
    d = _decisions(plan)
    assert d["model.layers.0.self_attn.o_proj.weight"].kept
    assert d["model.layers.0.self_attn.o_proj.weight"].reason == "--keep *.self_attn.*"
    assert d["model.layers.2.mlp.experts.0.down_proj.weight"].kept
    assert not d["model.layers.2.mlp.experts.1.down_proj.weight"].kept
    _, plan = plan_quantization(src=dsv3, scheme="fp8-block", default_keep=False)
    d = _decisions(plan)
    assert not d["lm_head.weight"].kept and not d["model.layers.1.mlp.gate.weight"].kept
    assert d["model.embed_tokens.weight"].kept  # embeddings are not Linear weights
    assert d["model.norm.weight"].reason == "not a Linear weight"


def test_kimi_recipe_mixed_precision(dsv3, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    recipe = RECIPES / "kimi-k2-int4-experts.yaml"
    out = tmp_path / "out"
    res = quantize(src=dsv3, out=out, recipe=recipe, progress=False)
    d = _decisions(res.plan)
    e = d["model.layers.1.mlp.experts.5.gate_proj.weight"]
    assert e.scheme.name == "w4a16" and e.scheme.group_size == 32
    assert d["model.layers.0.self_attn.kv_b_proj.weight"].scheme.name == "fp8-block"
    assert d["model.layers.1.mlp.shared_experts.up_proj.weight"].kept
    assert d["model.layers.0.mlp.up_proj.weight"].kept
    assert d["model.layers.0.mlp.up_proj.weight"].reason == "no rule matches"

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "mixed-precision"
    QuantizationConfig.model_validate(qc)
    groups = qc["config_groups"]
    # every quantized module is targeted by exactly one group and ignored by none;
    # every kept linear module is ignored
    for r in res.plan.rows:
        if not r.name.endswith(".weight"):
            continue
        hits = [g for g, s in groups.items() if any(match_name(r.module, t) for t in s["targets"])]
        ignored = any(match_name(r.module, t) for t in qc["ignore"])
        if r.kept:
            assert ignored, r.module
        else:
            assert len(hits) == 1 and not ignored, (r.module, hits)
            assert groups[hits[0]]["weights"] == r.scheme.weight_args()
    assert len(json.dumps(qc)) < 4000  # templated, not one entry per expert

    # our reader reads the mixed checkpoint back
    ck = open_checkpoint(out)
    src = open_checkpoint(dsv3)
    n = "model.layers.1.mlp.experts.5.gate_proj.weight"
    assert ck.meta(n).encoding == "pack-quantized"
    sd = ck.get_parts(n)["weight_scale"].dtype  # both are one rounding of the exact product
    assert torch.equal(ck.get(n, sd), e.scheme.dequantize(ck.get_parts(n)).to(sd))
    assert float((ck.get(n) - src.get(n)).norm() / src.get(n).norm()) < 0.12
    k = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(ck.get(k), src.get(k))


def test_fp8_block_source_requantized_without_dense_copy(tmp_path):
    """An FP8-block release re-quantized to int4 experts: decoded on the fly."""
    from k3convert.synth import synthesize

    src = tmp_path / "src"
    synthesize(config="deepseek-v3", out=src, tiny=True, encoding="fp8-block")
    s_ck = open_checkpoint(src)
    assert s_ck.meta("model.layers.3.mlp.experts.0.up_proj.weight").encoding == "fp8-block"
    out = tmp_path / "out"
    # the Kimi recipe minus its fp8-block attention rule: the tiny MLA widths (16, 32) are
    # below fp8-block's 128-channel activation groups, which the quantizer refuses
    recipe = load_recipe(RECIPES / "kimi-k2-int4-experts.yaml")
    recipe = replace(
        recipe,
        quantize=replace(
            recipe.quantize, rules=[r for r in recipe.quantize.rules if "attention" not in r.roles]
        ),
    )
    res = quantize(src=src, out=out, recipe=recipe, progress=False)
    ck = open_checkpoint(out)
    n = "model.layers.3.mlp.experts.0.up_proj.weight"
    assert ck.meta(n).encoding == "pack-quantized"
    rel = float((ck.get(n) - s_ck.get(n)).norm() / s_ck.get(n).norm())
    assert rel < 0.12
    # a kept FP8-block tensor is written dequantized in the config dtype
    k = "model.layers.0.mlp.gate_proj.weight"
    d = _decisions(res.plan)[k]
    assert d.kept and d.encoded and ck.meta(k).encoding == "plain"
    assert ck.meta(k).dtype == torch.bfloat16
    assert torch.equal(ck.get(k), s_ck.get(k).to(torch.bfloat16).float())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"


def test_dry_run_writes_nothing(dsv3, tmp_path):
    out = tmp_path / "out"
    res = quantize(src=dsv3, out=out, scheme="w4a16", dry_run=True, progress=False)
    assert not out.exists()
    assert res.dry_run and res.out is None
    t = res.table()
    assert "w4a16" in t and "kept" in t and "->" in t
    before, after = res.plan.totals()
    assert after < before
    assert "would write" in res.summary()


def test_rule_roles_and_patterns(dsv3):
    from k3convert.recipe import parse_recipe

    r = parse_recipe(
        {
            "quantize": {
                "rules": [
                    {"match": "re:.*layers\\.1\\..*", "scheme": "keep"},
                    {"roles": ["q_b_proj", "kv_b_proj"], "scheme": "w8a8"},
                    {"match": ["*.o_proj.weight"], "scheme": "fp8-dynamic"},
                    {"roles": "dense_mlp", "scheme": "w4a16", "options": {"group_size": 64}},
                ],
                "scheme": "fp8-block",
            }
        }
    )
    _, plan = plan_quantization(src=dsv3, recipe=r)
    d = _decisions(plan)
    assert d["model.layers.1.self_attn.q_b_proj.weight"].kept
    assert d["model.layers.0.self_attn.q_b_proj.weight"].scheme.name == "w8a8"
    assert d["model.layers.2.self_attn.o_proj.weight"].scheme.name == "fp8-dynamic"
    assert d["model.layers.0.mlp.down_proj.weight"].scheme.group_size == 64
    assert d["model.layers.2.mlp.experts.0.up_proj.weight"].scheme.name == "fp8-block"
    assert d["model.layers.2.mlp.experts.0.up_proj.weight"].reason == "--scheme"


def test_recipe_errors():
    with pytest.raises(ConfigError, match=r"quantize\.rules\[0\]\.sheme.*did you mean 'scheme'"):
        parse_recipe({"quantize": {"rules": [{"sheme": "w4a16"}]}})
    with pytest.raises(ConfigError, match=r"unknown key 'quantise'.*did you mean 'quantize'"):
        parse_recipe({"quantise": {}})
    with pytest.raises(ConfigError, match=r"rules\[1\].*unknown quantization scheme 'w4a17'"):
        parse_recipe({"quantize": {"rules": [{"scheme": "keep"}, {"scheme": "w4a17"}]}})
    with pytest.raises(ConfigError, match=r"no option 'group'"):
        parse_recipe({"quantize": {"rules": [{"scheme": "w4a16", "options": {"group": 32}}]}})
    with pytest.raises(ConfigError, match="invalid regex"):
        parse_recipe({"quantize": {"scheme": "w4a16", "keep": ["re:(("]}})
    with pytest.raises(ConfigError, match="must be true or false"):
        parse_recipe({"quantize": {"scheme": "w4a16", "default_keep": "yes"}})
    with pytest.raises(ConfigError, match=r"missing required key 'quantize\.rules\[0\]\.scheme'"):
        parse_recipe({"quantize": {"rules": [{"roles": ["experts"]}]}})


def test_unknown_role_names_nearest(dsv3):
    # refused with the recipe, before any model is read
    with pytest.raises(ConfigError, match=r"unknown role 'expert'.*Did you mean 'experts'"):
        parse_recipe({"quantize": {"rules": [{"roles": ["expert"], "scheme": "w4a16"}]}})
    # a kind of another architecture (KDA's b_proj): the recipe names no model type, so
    # only the checkpoint's own tensors can refuse it
    r = parse_recipe({"quantize": {"rules": [{"roles": ["b_proj"], "scheme": "w4a16"}]}})
    with pytest.raises(ConfigError, match=r"unknown role 'b_proj'"):
        plan_quantization(src=dsv3, recipe=r)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")))
def test_preset_recipes_parse(path):
    r = load_recipe(path)
    assert r.quantize.rules or r.quantize.scheme
