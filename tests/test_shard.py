"""Resharding: layout arithmetic, split rules and lossless reassembly for every family."""

from __future__ import annotations

import json

import jsonschema
import pytest

from k3convert.errors import ConfigError, OutputError
from k3convert.shard import Layout, SplitError, partition_layers, place_experts, shard
from k3convert.stream import read_manifest_doc
from tests.test_shard_support import add_mtp, assert_lossless, fp8_block, int4_group

SCHEMA = json.loads(
    (
        __import__("pathlib").Path(__file__).parents[1] / "formats/musa-stream.schema.json"
    ).read_text()
)


def run(src, out, **kw):
    kw.setdefault("progress", False)
    r = shard(src=src, out=out, **kw)
    top = json.loads(r.manifest.read_text())
    jsonschema.validate(top, SCHEMA)
    rank_schema = {"$ref": "#/$defs/rank_file", "$defs": SCHEMA["$defs"]}
    for rk in top["ranks"]:
        jsonschema.validate(json.loads((r.out / rk["units_file"]).read_text()), rank_schema)
    man = read_manifest_doc(r.out)  # every rank's units inline
    return r, man


# -- layout -----------------------------------------------------------------------------
def test_layout_rank_arithmetic():
    lay = Layout(tp=8, pp=2, moe_ep=4)
    assert lay.moe_tp == 2 and lay.world == 16
    assert lay.rank(1, 3) == 11
    assert lay.coords(11) == dict(pp_rank=1, tp_rank=3, ep_rank=1, moe_tp_rank=1)
    with pytest.raises(ConfigError, match="ep=3 must divide tp=8"):
        Layout(tp=8, moe_ep=3)
    with pytest.raises(ConfigError, match="moe_tp \\* moe_ep"):
        Layout(tp=8, moe_tp=2, moe_ep=2)


def test_partition_balances_bytes_and_takes_explicit():
    # stage 0 also carries a heavy embedding: it should get fewer layers
    assert partition_layers([10] * 6, 2, first_fixed=20) == [(0, 2), (2, 6)]
    assert partition_layers([10] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert partition_layers([1, 1, 1, 9], 2) == [(0, 3), (3, 4)]
    assert partition_layers([5] * 4, 2, explicit=[1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ConfigError, match="summing to the model's 4"):
        partition_layers([5] * 4, 2, explicit=[1, 1])


def test_expert_placement_contiguous_balanced_and_redundant():
    assert place_experts(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    load = [100, 1, 1, 1, 50, 50, 1, 1]
    bins = place_experts(8, 2, load=load)
    tot = [sum(load[e] for e in b) for b in bins]
    assert sorted(len(b) for b in bins) == [4, 4] and max(tot) - min(tot) <= 3
    assert 0 in bins[0] and {4, 5} <= set(bins[1])  # hottest alone vs the two warm ones
    red = place_experts(8, 4, load=load, redundant=4)
    assert all(len(b) == 3 for b in red)
    copies = [sum(e in b for b in red) for e in range(8)]
    assert copies[0] >= 2 and sum(copies) == 12  # the hottest expert is replicated
    assert all(len(set(b)) == len(b) for b in red)  # never two copies on one rank
    with pytest.raises(ConfigError, match="needs routing counts"):
        place_experts(8, 4, redundant=4)
    with pytest.raises(ConfigError, match="cannot be spread evenly"):
        place_experts(8, 3)
    # too many copies: the largest valid count and the fix are named, and it is valid
    with pytest.raises(ConfigError, match=r"at most 8 copies .*--redundant-experts 8.*"
                       r"--set layout.redundant_experts=8"):  # fmt: skip
        place_experts(8, 2, load=load, redundant=10)
    assert all(sorted(b) == list(range(8)) for b in place_experts(8, 2, load=load, redundant=8))


# -- lossless reassembly ----------------------------------------------------------------
MATRIX = [
    ("llama", {}, (1, 1, 1)),
    ("llama", {}, (2, 2, 1)),  # tp == kv heads
    ("llama", {}, (4, 1, 1)),  # tp > kv heads: KV heads replicated
    ("llama", {"num_attention_heads": 8, "vocab_size": 157}, (8, 3, 1)),  # vocab padding
    ("qwen3", {}, (2, 3, 1)),  # tied embeddings, pp > layers
    ("qwen3", {}, (4, 2, 1)),
    ("qwen3_moe", {}, (4, 1, 2)),
    ("qwen3_moe", {}, (4, 2, 4)),
    ("mixtral", {}, (2, 2, 2)),
    ("mixtral", {}, (4, 1, 4)),
    ("deepseek_v3", {}, (2, 1, 1)),  # routed experts split by moe_tp
    ("deepseek_v3", {}, (4, 3, 4)),
    ("deepseek_v3", {"num_attention_heads": 8}, (8, 2, 4)),
    ("deepseek_v3", {"q_lora_rank": None, "tie_word_embeddings": True}, (2, 2, 2)),
    ("kimi_k25", {}, (2, 2, 2)),
    ("kimi_k25", {}, (4, 1, 1)),
]


@pytest.mark.parametrize(
    "family,kw,layout", MATRIX, ids=[f"{f}-{'-'.join(map(str, lay))}" for f, _, lay in MATRIX]
)
def test_lossless(model_factory, tmp_path, family, kw, layout):
    tp, pp, ep = layout
    src = model_factory(family, **kw)
    r, man = run(src, tmp_path / "out", tp=tp, pp=pp, ep=ep, workers=2)
    assert r.units_written == sum(len(x["units"]) for x in man["ranks"])
    assert_lossless(src, r.out)
    lay = man["layout"]
    assert (lay["tp"], lay["pp"], lay["moe_ep"], lay["world"]) == (tp, pp, ep, tp * pp)
    # execution order per rank; stage 0 starts with embed (+ vision), the last ends at head
    order = {"embed": 0, "vision": 1, "layer": 2, "head": 3, "mtp": 4}
    for rk in man["ranks"]:
        names = [u["name"] for u in rk["units"]]
        keys = [(order[n.split(".")[0]], int(n.split(".")[1]) if "." in n else 0) for n in names]
        assert keys == sorted(keys)
        assert ("embed" in names) == (rk["pp_rank"] == 0)
        assert ("head" in names) == (rk["pp_rank"] == pp - 1)
        if family == "kimi_k25":
            assert ("vision" in names) == (rk["pp_rank"] == 0)
    for stage in lay["stages"]:
        assert stage["units"] == [u["name"] for u in man["ranks"][stage["pp_rank"] * tp]["units"]]
    (out_cfg,) = [f for f in man["files"] if f["name"] == "config.json"]
    assert (r.out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert out_cfg["bytes"] == (src / "config.json").stat().st_size


def test_tp_above_kv_heads_replicates_kv(model_factory, tmp_path):
    src = model_factory("llama")  # 4 heads, 2 KV heads
    _, man = run(src, tmp_path / "o", tp=4)
    k = {
        rk["tp_rank"]: e
        for rk in man["ranks"]
        for u in rk["units"]
        for e in u["tensors"]
        if e["name"] == "model.layers.0.self_attn.k_proj.weight"
    }
    assert [k[t]["offset"] for t in range(4)] == [0, 0, 16, 16]
    assert all(k[t]["shape"] == [16, 64] for t in range(4))


def test_vocab_padding_and_tied_head(model_factory, tmp_path):
    src = model_factory("qwen3", vocab_size=157)  # tied embeddings
    _, man = run(src, tmp_path / "o", tp=4, pp=2)
    ents = [(rk["tp_rank"], e) for rk in man["ranks"] for u in rk["units"] for e in u["tensors"]]
    emb = {t: e for t, e in ents if e["name"] == "model.embed_tokens.weight"}
    head = {t: e for t, e in ents if e["name"] == "lm_head.weight"}
    assert [emb[t]["offset"] for t in range(4)] == [0, 40, 80, 120]
    assert [emb[t]["pad"] for t in range(4)] == [0, 0, 0, 3]
    assert all(e["shape"] == [40, 64] for e in emb.values())
    assert all(e["tied_to"] == "model.embed_tokens.weight" for e in head.values())
    assert_lossless(src, tmp_path / "o")


def test_mtp_layers_on_last_stage(model_factory, tmp_path):
    src = add_mtp(model_factory("deepseek_v3"), tmp_path / "mtp")
    r, man = run(src, tmp_path / "o", tp=2, pp=2, ep=2)
    assert man["model"]["num_mtp_layers"] == 1
    assert man["layout"]["stages"][-1]["units"][-2:] == ["head", "mtp.3"]
    assert "3" in man["layout"]["experts"]["layers"]
    assert_lossless(src, r.out)


def test_expert_load_balancing_with_redundant_copies(model_factory, tmp_path):
    src = model_factory("qwen3_moe")  # 2 MoE layers of 8 experts
    load = {0: [900, 10, 10, 10, 10, 10, 10, 40], 1: [5, 5, 5, 5, 5, 5, 5, 500]}
    _, man = run(src, tmp_path / "o", tp=4, ep=4, expert_load=load, redundant_experts=4)
    ex = man["layout"]["experts"]
    assert ex["policy"] == "load" and ex["redundant"] == 4
    assert len(ex["layers"]["0"]["expert_ep_ranks"][0]) >= 2  # hottest expert replicated
    assert len(ex["layers"]["1"]["expert_ep_ranks"][7]) >= 2
    assert all(len(b) == 3 for b in ex["layers"]["0"]["ep_rank_experts"])
    held = {
        (rk["ep_rank"], e["expert"])
        for rk in man["ranks"]
        for u in rk["units"]
        if u["layer"] == 0
        for e in u["tensors"]
        if e["expert"] is not None
    }
    assert held == {(r, e) for r, b in enumerate(ex["layers"]["0"]["ep_rank_experts"]) for e in b}
    assert_lossless(src, tmp_path / "o")
    with pytest.raises(ConfigError, match="no routing counts for MoE layer"):
        run(src, tmp_path / "o2", tp=4, ep=4, expert_load={0: [1] * 8})


def test_explicit_pp_layers(model_factory, tmp_path):
    src = model_factory("deepseek_v3")
    _, man = run(src, tmp_path / "o", pp=2, pp_layers=[2, 1])
    assert [s["layers"] for s in man["layout"]["stages"]] == [[0, 2], [2, 3]]


# -- quantized inputs -------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_deepseek(model_factory, tmp_path_factory):
    return fp8_block(model_factory("deepseek_v3"), tmp_path_factory.mktemp("q") / "fp8")


@pytest.fixture(scope="module")
def int4_llama(model_factory, tmp_path_factory):
    return int4_group(model_factory("llama"), tmp_path_factory.mktemp("q") / "int4")


@pytest.mark.parametrize("layout", [(4, 1, 2), (2, 2, 2), (4, 3, 4)])
def test_lossless_fp8_block(fp8_deepseek, tmp_path, layout):
    tp, pp, ep = layout
    r, man = run(fp8_deepseek, tmp_path / "o", tp=tp, pp=pp, ep=ep)
    ents = [e for rk in man["ranks"] for u in rk["units"] for e in u["tensors"]]
    scales = [e for e in ents if e["part"] == "weight_scale_inv" and e["split_dim"] is not None]
    assert scales and all(e["encoding"] == "fp8-block" for e in scales)
    assert all(e["quant"]["block"] == [8, 8] for e in scales)
    assert_lossless(fp8_deepseek, r.out)


@pytest.mark.parametrize("layout,compress", [((4, 1, 1), "none"), ((2, 2, 1), "zstd")])
def test_lossless_int4(int4_llama, tmp_path, layout, compress):
    tp, pp, ep = layout
    r, man = run(int4_llama, tmp_path / "o", tp=tp, pp=pp, ep=ep, compress=compress)
    ents = [e for rk in man["ranks"] for u in rk["units"] for e in u["tensors"]]
    parts = {e["part"] for e in ents if e["encoding"] == "pack-quantized"}
    assert parts == {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}
    o_packed = [e for e in ents if e["name"].endswith("o_proj.weight_packed")]
    assert {e["split_dim"] for e in o_packed} == {1}
    assert all(e["shape"] == [64, 64 // tp // 8] for e in o_packed)  # 8 int4 per word
    shapes = [e for e in ents if e["part"] == "weight_shape" and "o_proj" in e["name"]]
    assert all(e["contents"] == "local_shape" for e in shapes)
    assert_lossless(int4_llama, r.out)


def test_split_cutting_fp8_block_fails_up_front(model_factory, tmp_path):
    src = fp8_block(model_factory("deepseek_v3"), tmp_path / "fp8", block=(32, 32))
    with pytest.raises(SplitError) as ei:
        shard(src=src, out=tmp_path / "o", tp=4, progress=False)
    msg = str(ei.value)
    assert "self_attn.kv_b_proj.weight" in msg or "q_b_proj.weight" in msg or "mlp" in msg
    assert "along dim" in msg and "Degrees that work for this tensor: [1" in msg
    assert not (tmp_path / "o").exists()  # nothing written


def test_split_cutting_int4_group_names_tensor_dim_and_degrees(model_factory, tmp_path):
    src = int4_group(model_factory("llama", num_attention_heads=8), tmp_path / "i4", group=16)
    with pytest.raises(SplitError) as ei:
        shard(src=src, out=tmp_path / "o", tp=8, progress=False)
    msg = str(ei.value)
    assert "o_proj.weight" in msg and "along dim 1" in msg and "tp=8" in msg
    assert "[1, 2, 4]" in msg
    assert not (tmp_path / "o").exists()


def test_heads_not_divisible_fails(model_factory, tmp_path):
    with pytest.raises(SplitError, match="attention heads"):
        shard(src=model_factory("llama"), out=tmp_path / "o", tp=8, progress=False)


# -- output directory handling ----------------------------------------------------------
def test_refuses_complete_output_unless_force(model_factory, tmp_path):
    src = model_factory("llama")
    run(src, tmp_path / "o", tp=2)
    with pytest.raises(OutputError, match="complete stream"):
        run(src, tmp_path / "o", tp=2)
    r, _ = run(src, tmp_path / "o", tp=2, force=True)
    assert r.units_written > 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    with pytest.raises(OutputError, match="not an interrupted k3convert shard"):
        run(src, tmp_path / "other", tp=2)
