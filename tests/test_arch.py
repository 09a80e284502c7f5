"""Architecture tables against checkpoints and models that transformers built.

Oracles: the names and shapes transformers' ``save_pretrained`` wrote, and
``sum(p.numel())`` of the transformers model itself. Variants cover the config flags
each table branches on (tied embeddings, biases, q_lora_rank=None, dense/MoE layer
placement, shared experts, MTP layers, vision merge kernel...).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from k3convert import arch as A
from k3convert.arch import COMPONENTS, SPLITS, Role
from k3convert.checkpoint import open_checkpoint
from k3convert.errors import ArchError, ConfigError, UnknownTensorsError
from tests.conftest import FAMILIES
from tests.encode import append_mtp_layer
from tests.models import build_model

# (family, overrides) built through model_factory; ids name the variant
VARIANTS = {
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-tied-headdim": ("llama", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True, tie_word_embeddings=False)),
    "qwen3_moe-mlp_only": ("qwen3_moe", dict(mlp_only_layers=[0])),
    "qwen3_moe-sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=4)),
    "qwen3_moe-tied": ("qwen3_moe", dict(tie_word_embeddings=True)),
    "mixtral-tied": ("mixtral", dict(tie_word_embeddings=True)),
    "dsv3-no_q_lora": ("deepseek_v3", dict(q_lora_rank=None)),
    "dsv3-all_moe": ("deepseek_v3", dict(first_k_dense_replace=0)),
    "dsv3-2shared": ("deepseek_v3", dict(n_shared_experts=2)),
    "dsv3-bias-tied": ("deepseek_v3", dict(attention_bias=True, tie_word_embeddings=True)),
    "kimi_k25-untied-proj": ("kimi_k25", dict(tie_word_embeddings=False,
                                             projection_hidden_size=48)),
    "kimi_k25-merge12": ("kimi_k25", dict(vision_config=dict(merge_kernel_size=[1, 2]))),
}  # fmt: skip


@pytest.fixture(scope="module")
def case(tiny_models, model_factory):
    """case(id) -> (checkpoint dir, the transformers model that was saved)."""
    cache: dict = {}

    def get(cid: str):
        if cid not in cache:
            if cid in FAMILIES:
                cache[cid] = (tiny_models[cid], build_model(cid))
            elif cid in ("qwen2", "mistral"):  # served by alias: built here, not session-wide
                cache[cid] = (model_factory(cid), build_model(cid))
            else:
                fam, kw = VARIANTS[cid]
                cache[cid] = (model_factory(fam, **kw), build_model(fam, **kw))
        return cache[cid]

    return get


ALL_CASES = [*FAMILIES, "qwen2", "mistral", *VARIANTS]


def _opened(d):
    ck = open_checkpoint(d)
    a, cfg = A.resolve(ck.config)
    return ck, a, cfg


@pytest.mark.parametrize("cid", ALL_CASES)
def test_every_tensor_has_a_role(case, cid):
    ck, a, cfg = _opened(case(cid)[0])
    roles = a.classify(cfg, ck.names())
    assert set(roles) == set(ck.names())
    for n, r in roles.items():
        assert isinstance(r, Role)
        assert r.component in COMPONENTS and r.split in SPLITS, n
        assert r.kind, n


@pytest.mark.parametrize("cid", ALL_CASES)
def test_instances_equal_the_saved_checkpoint(case, cid):
    ck, a, cfg = _opened(case(cid)[0])
    canon = a.canonical(cfg, ck.names())
    saved = {canon[n]: ck.meta(n).shape for n in ck.names()}
    assert len(saved) == len(ck.names()), "two saved names share one canonical name"
    inst = list(a.instances(cfg))
    expected = {i.name: i.shape for i in inst}
    assert len(expected) == len(inst), "instances yields a name twice"
    assert expected == saved
    assert a.expected_shapes(cfg, ck.names()) == {n: ck.meta(n).shape for n in ck.names()}


@pytest.mark.parametrize("cid", ALL_CASES)
def test_parameter_total_equals_transformers_model(case, cid):
    """sum over instances == the transformers model's parameters, counted once each.

    ``model.parameters()`` yields a tied lm_head / embedding once, matching a table
    without lm_head under tie_word_embeddings. DeepSeek's e_score_correction_bias is a
    (saved) buffer in transformers, not a parameter, so it is added explicitly.
    """
    d, model = case(cid)
    _, a, cfg = _opened(d)
    ours = sum(torch.Size(i.shape).numel() for i in a.instances(cfg))
    params = list(model.parameters())
    assert len({id(p) for p in params}) == len(params)
    theirs = sum(p.numel() for p in params)
    theirs += sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    assert ours == theirs
    if getattr(model.config, "tie_word_embeddings", False):
        assert not any(i.role.kind == "lm_head" for i in a.instances(cfg))


def test_tied_weights_are_one_parameter(case):
    _, model = case("qwen3")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


# -- roles -----------------------------------------------------------------------------


def _roles(case, cid):
    ck, a, cfg = _opened(case(cid)[0])
    return a.classify(cfg, ck.names()), cfg


def test_deepseek_v3_roles(case):
    roles, cfg = _roles(case, "deepseek_v3")
    r = roles["model.layers.1.mlp.gate.weight"]
    assert (r.component, r.kind, r.keep, r.split, r.layer) == ("router", "router", True,
                                                               "replicate", 1)  # fmt: skip
    r = roles["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert (r.component, r.keep, r.layer) == ("router", True, 2)
    for e in range(cfg.num_experts):
        for proj, split in (("gate_proj", "col"), ("up_proj", "col"), ("down_proj", "row")):
            r = roles[f"model.layers.2.mlp.experts.{e}.{proj}.weight"]
            assert (r.component, r.kind, r.expert, r.layer, r.split) == (
                "routed_experts", proj, e, 2, split)  # fmt: skip
            assert not r.keep and r.unit == "layer.2"
    r = roles["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert (r.component, r.split, r.expert) == ("shared_experts", "row", None)
    r = roles["model.layers.0.mlp.gate_proj.weight"]
    assert (r.component, r.split, r.layer) == ("dense_mlp", "col", 0)
    attn = "model.layers.0.self_attn."
    want = {
        "q_a_proj": "replicate",
        "q_b_proj": "heads",
        "kv_a_proj_with_mqa": "replicate",
        "kv_b_proj": "heads",
        "o_proj": "row",
    }
    for k, split in want.items():
        r = roles[attn + k + ".weight"]
        assert (r.component, r.kind, r.split) == ("attention", k, split), k
    for k in ("q_a_layernorm", "kv_a_layernorm"):
        r = roles[attn + k + ".weight"]
        assert (r.component, r.keep, r.split) == ("norms", True, "replicate")
    r = roles["model.embed_tokens.weight"]
    assert (r.component, r.split, r.keep, r.unit, r.layer) == ("embeddings", "vocab", True,
                                                               "embed", None)  # fmt: skip
    r = roles["lm_head.weight"]
    assert (r.component, r.split, r.keep, r.unit) == ("head", "vocab", True, "head")
    r = roles["model.norm.weight"]
    assert (r.component, r.keep, r.unit) == ("norms", True, "head")
    assert not any(r.mtp for r in roles.values())
    assert {r.split_dim for r in roles.values()} <= {None, 0, 1}
    assert roles["model.layers.0.self_attn.o_proj.weight"].split_dim == 1


def test_deepseek_v3_without_q_lora(case):
    roles, cfg = _roles(case, "dsv3-no_q_lora")
    assert cfg.q_lora_rank is None
    r = roles["model.layers.0.self_attn.q_proj.weight"]
    assert (r.kind, r.split, r.component) == ("q_proj", "heads", "attention")
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in roles)


@pytest.mark.parametrize("cid", ["llama", "qwen3", "qwen2", "llama-bias"])
def test_dense_gqa_roles(case, cid):
    roles, _ = _roles(case, cid)
    p = "model.layers.1.self_attn."
    assert roles[p + "q_proj.weight"].split == "heads"
    assert roles[p + "k_proj.weight"].split == "kv_heads"
    assert roles[p + "v_proj.weight"].split == "kv_heads"
    assert roles[p + "o_proj.weight"].split == "row"
    m = "model.layers.1.mlp."
    assert [roles[m + k + ".weight"].split for k in ("gate_proj", "up_proj", "down_proj")] == [
        "col", "col", "row"]  # fmt: skip
    assert all(r.component != "routed_experts" for r in roles.values())
    if p + "q_proj.bias" in roles:
        assert roles[p + "q_proj.bias"].split == "heads"
        assert roles[p + "k_proj.bias"].split == "kv_heads"
    if cid == "qwen3":
        assert roles[p + "q_norm.weight"].keep and roles[p + "q_norm.weight"].component == "norms"
    assert all(r.keep for n, r in roles.items() if "norm" in n)
    assert all(r.layer == int(n.split(".")[2]) for n, r in roles.items() if ".layers." in n)


@pytest.mark.parametrize("cid", ["qwen3_moe", "mixtral"])
def test_softmax_moe_roles(case, cid):
    roles, cfg = _roles(case, cid)
    moe = "block_sparse_moe" if cid == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if cid == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    r = roles[f"model.layers.0.{moe}.gate.weight"]
    assert (r.component, r.keep) == ("router", True)
    for e in range(cfg.num_experts):
        for n, kind, split in zip(names, ("gate_proj", "up_proj", "down_proj"),
                                  ("col", "col", "row"), strict=True):  # fmt: skip
            r = roles[f"model.layers.1.{moe}.experts.{e}.{n}.weight"]
            assert (r.component, r.kind, r.expert, r.layer, r.split) == (
                "routed_experts", kind, e, 1, split)  # fmt: skip


def test_qwen3_moe_dense_layers(case):
    roles, cfg = _roles(case, "qwen3_moe-mlp_only")
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    assert roles["model.layers.0.mlp.gate_proj.weight"].component == "dense_mlp"
    assert roles["model.layers.1.mlp.gate.weight"].component == "router"
    roles, cfg = _roles(case, "qwen3_moe-sparse_step")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_kimi_k25_roles_and_aliases(case):
    ck, a, cfg = _opened(case("kimi_k25")[0])
    roles = a.classify(cfg, ck.names())
    canon = a.canonical(cfg, ck.names())
    # transformers writes the decoder stack as 'blocks'; the canonical name is 'layers'
    n = "language_model.model.blocks.2.mlp.experts.5.down_proj.weight"
    assert canon[n] == "language_model.model.layers.2.mlp.experts.5.down_proj.weight"
    r = roles[n]
    assert (r.component, r.expert, r.layer, r.split) == ("routed_experts", 5, 2, "row")
    assert canon["model.mm_projector.pre_norm.weight"] == "mm_projector.pre_norm.weight"
    assert roles["model.mm_projector.pre_norm.weight"].component == "projector"
    r = roles["vision_tower.encoder.patch_embed.proj.weight"]
    assert (r.component, r.keep, r.unit) == ("vision", True, "vision")
    r = roles["vision_tower.encoder.blocks.1.wqkv.weight"]
    assert (r.component, r.block, r.layer, r.unit) == ("vision", 1, None, "vision")
    assert roles["mm_projector.proj.2.weight"].component == "projector"
    r = roles["language_model.model.blocks.1.mlp.gate.weight"]
    assert (r.component, r.keep) == ("router", True)
    # canonical names classify to the same roles as the aliases
    by_canon = a.classify(cfg, canon.values())
    assert all(by_canon[canon[n]] == r for n, r in roles.items())
    for n, r in roles.items():
        if n.startswith("vision_tower") or "mm_projector" in n:
            assert r.split == "replicate", n


def test_instances_roles_match_classify(case):
    _, a, cfg = _opened(case("deepseek_v3")[0])
    inst = list(a.instances(cfg))
    roles = a.classify(cfg, [i.name for i in inst])
    assert all(roles[i.name] == i.role for i in inst)


# -- multi-token prediction layers -----------------------------------------------------


@pytest.fixture(scope="module")
def mtp_dir(tiny_models, tmp_path_factory):
    return append_mtp_layer(tiny_models["deepseek_v3"], tmp_path_factory.mktemp("mtp") / "m")


def test_mtp_layer_roles(mtp_dir):
    ck, a, cfg = _opened(mtp_dir)
    assert cfg.num_mtp == 1 and cfg.num_layers == 3
    roles = a.classify(cfg, ck.names())
    mtp = {n: r for n, r in roles.items() if n.startswith("model.layers.3.")}
    assert len(mtp) == 6 + sum(1 for n in ck.names() if n.startswith("model.layers.2."))
    for n, r in mtp.items():
        assert r.mtp and r.component == "mtp" and r.keep and r.layer == 3, n
        assert r.unit == "mtp.3"
    kinds = {n.removeprefix("model.layers.3."): r.kind for n, r in mtp.items()}
    assert kinds["enorm.weight"] == "mtp_enorm" and kinds["hnorm.weight"] == "mtp_hnorm"
    assert kinds["eh_proj.weight"] == "mtp_eh_proj"
    assert kinds["shared_head.head.weight"] == "mtp_head"
    assert kinds["shared_head.norm.weight"] == "mtp_head_norm"
    assert kinds["embed_tokens.weight"] == "mtp_embed_tokens"
    assert kinds["mlp.experts.7.down_proj.weight"] == "down_proj"
    assert mtp["model.layers.3.mlp.experts.7.down_proj.weight"].expert == 7
    assert not any(r.mtp for n, r in roles.items() if n not in mtp)


def test_mtp_instances_equal_checkpoint(mtp_dir, tiny_models):
    ck, a, cfg = _opened(mtp_dir)
    inst = {i.name: i.shape for i in a.instances(cfg)}
    assert inst == {n: ck.meta(n).shape for n in ck.names()}
    base = open_checkpoint(tiny_models["deepseek_v3"])
    no_mtp = {i.name: i.shape for i in a.instances(cfg, mtp=False)}
    assert no_mtp == {n: base.meta(n).shape for n in base.names()}


def test_mtp_layer_beyond_num_nextn_is_unknown(mtp_dir):
    ck, a, _ = _opened(mtp_dir)
    raw = json.loads((mtp_dir / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0
    cfg0 = a.parse_config(raw)
    with pytest.raises(UnknownTensorsError) as ei:
        a.classify(cfg0, ck.names())
    assert ei.value.names and all(n.startswith("model.layers.3.") for n in ei.value.names)


# -- registry and errors ---------------------------------------------------------------


def test_registry_aliases():
    known = A.known_model_types()
    for mt in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "deepseek_v3",
               "kimi_k2", "kimi_k25"):  # fmt: skip
        assert mt in known
    assert A.get_arch("kimi_k2") is A.get_arch("deepseek_v3")
    assert A.get_arch("mixtral") is A.get_arch("qwen3_moe")
    assert {A.get_arch(m).name for m in ("qwen2", "qwen3", "mistral")} == {"llama"}


def test_kimi_k2_config_reads_as_deepseek_v3(case):
    ck = open_checkpoint(case("deepseek_v3")[0])
    a, cfg = A.resolve({**ck.config, "model_type": "kimi_k2"})
    assert a.name == "deepseek_v3" and cfg.model_type == "kimi_k2"
    assert len(a.classify(cfg, ck.names())) == len(ck.names())


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(ArchError) as ei:
        A.get_arch("falcon_h9")
    msg = str(ei.value)
    assert "falcon_h9" in msg
    for mt in A.known_model_types():
        assert re.search(rf"\b{mt}\b", msg), mt
    with pytest.raises(ArchError, match="falcon_h9"):
        A.resolve({"model_type": "falcon_h9", "hidden_size": 8})


def test_missing_model_type_is_a_config_error():
    with pytest.raises(ConfigError, match="model_type"):
        A.resolve({"hidden_size": 8})


def test_unknown_names_are_listed_not_dropped(case):
    ck, a, cfg = _opened(case("mixtral")[0])
    bad = [
        "model.layers.0.block_sparse_moe.experts.4.w1.weight",  # 4 experts: 0..3
        "model.layers.2.input_layernorm.weight",  # 2 layers
        "model.layers.0.mlp.gate_proj.weight",  # qwen3_moe spelling, not mixtral's
        "transformer.h.0.attn.c_attn.weight",
    ]
    with pytest.raises(UnknownTensorsError) as ei:
        a.classify(cfg, [*ck.names(), *bad], where="some/dir")
    assert ei.value.names == bad
    msg = str(ei.value)
    assert "some/dir" in msg and "4 tensor name(s)" in msg
    for n in bad:
        assert n in msg


def test_unknown_names_message_is_bounded():
    a = A.get_arch("llama")
    cfg = a.parse_config(json.loads(json.dumps(build_model("llama").config.to_dict())))
    bad = [f"junk.{i}.weight" for i in range(20)]
    with pytest.raises(UnknownTensorsError) as ei:
        a.classify(cfg, bad)
    assert ei.value.names == bad and "and 12 more" in str(ei.value)


def test_load_config(tiny_models, tmp_path):
    d = tiny_models["qwen3_moe"]
    assert A.load_config(d) == A.load_config(d / "config.json")
    assert A.load_config(d)["model_type"] == "qwen3_moe"
    with pytest.raises(ConfigError, match=str(tmp_path)):
        A.load_config(tmp_path)


@pytest.mark.parametrize(
    ("family", "edit", "key"),
    [
        ("deepseek_v3", {"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ("deepseek_v3", {"n_group": 3}, "n_group"),
        ("deepseek_v3", {"hidden_size": 0}, "hidden_size"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("llama", {"vocab_size": None}, "vocab_size"),
    ],
)
def test_bad_config_values(tiny_models, family, edit, key):
    raw = {**A.load_config(tiny_models[family]), **edit}
    with pytest.raises(ConfigError, match=key):
        A.resolve(raw)


@pytest.mark.parametrize("preset", __import__("k3convert.synth", fromlist=["PRESETS"]).PRESETS)
def test_arch_family_facts_are_the_runtimes(preset):
    """The family facts the KV-cache code reads from the Arch (attention kind per layer,
    router, where the decoder's config is) are the ones the runtime's decoder settings
    use, for every bundled release."""
    from k3convert.arch import resolve
    from k3convert.runtime.decoder import text_settings
    from k3convert.synth import preset_config

    raw = preset_config(preset)
    arch, cfg = resolve(raw, preset)
    text = getattr(cfg, "text", cfg)
    ts = text_settings(arch.name, text, arch.text_raw(raw), preset)
    kinds = [arch.attention_of(cfg, i) for i in range(text.num_layers)]
    assert kinds == [ts.attention_of(i) for i in range(text.num_layers)]
    assert (ts.family, ts.attention, ts.router) == (arch.name, arch.attention, arch.router)
    assert ("kda" in kinds) == arch.hybrid
    # the KV-cache scales' names the arch table declares are under attention_prefix
    scales = sorted(s.pattern for s in arch.specs(cfg) if s.kind in ("k_scale", "v_scale"))
    assert scales == [arch.attention_prefix + "k_scale", arch.attention_prefix + "v_scale"]


def test_the_runtime_refuses_an_alias_name():
    """text_settings takes the canonical family name, as the runtime passes it."""
    from k3convert.arch import resolve
    from k3convert.runtime.decoder import text_settings
    from k3convert.synth import preset_config

    raw = preset_config("kimi-k2")
    arch, cfg = resolve(raw, "kimi-k2")
    assert arch.name == "deepseek_v3" and "kimi_k2" in arch.aliases
    with pytest.raises(ConfigError, match="no forward pass for 'kimi_k2'"):
        text_settings("kimi_k2", cfg, raw, "x")
