"""Kimi K3 at the release's breadth: all 896 routed experts (16 active, 2 shared), the
release's 96 attention / KDA heads and 163840-token vocabulary, through the kimi-k3-day0
preset at one stage of its layout (tp8 ep8, 64 redundant experts placed by calibration;
the preset's pp2 is set to 1: the two layers here would leave the MoE one alone in a
stage, and the breadth, not the depth, is the point).

Why: the other tests use a handful of experts, and what only goes wrong at 896 per layer
(placement with redundant copies, per-rank bytes, manifest size, per-tensor overheads)
needs the real count. Depth and widths are small (2 layers: a KDA dense one and an MLA
MoE one; ``synth --tiny`` widths); bench/rehearse_k3.py runs the same at the release's
93 layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3convert.memplan import plan_memory
from k3convert.pipeline.convert import convert
from k3convert.recipe import load_recipe
from k3convert.stream import open_stream, read_manifest_doc
from k3convert.synth import synthesize
from tests.test_memplan import _manifest_bytes

EXPERTS, LAYERS, VOCAB, HEADS = 896, 2, 163840, 96
ONE_STAGE = ["layout.pp=1"]


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> tuple[Path, Path, object]:
    d = tmp_path_factory.mktemp("k3full")
    src, out = d / "k3", d / "k3.stream"
    dims = {"layers": LAYERS, "experts": EXPERTS, "topk": 16, "heads": HEADS, "vocab": VOCAB}
    synthesize(config="kimi-k3", out=src, tiny=True, overrides=dims)
    ids = d / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": [(97 * i + 31 * s) % VOCAB
                                                     for i in range(16)]}) + "\n"
                           for s in range(2)))  # fmt: skip
    sets = [f"quantize.calibrate.dataset={ids}", "quantize.calibrate.num_samples=2",
            "quantize.calibrate.seq_len=16", "verify.samples=1", "verify.seq_len=8",
            "verify.decode=1", *ONE_STAGE]  # fmt: skip
    res = convert(src=src, out=out, recipe="kimi-k3-day0", overrides=sets, progress=False)
    return src, out, res


def test_release_shape_is_kept(k3):
    src, _, _ = k3
    t = json.loads((src / "config.json").read_text())["text_config"]
    assert (t["num_experts"], t["num_experts_per_token"], t["num_shared_experts"]) == (896, 16, 2)
    assert t["num_attention_heads"] == t["linear_attn_config"]["num_heads"] == HEADS
    assert t["vocab_size"] == VOCAB and t["num_hidden_layers"] == LAYERS


def test_day0_layout_converts_and_verifies(k3):
    _, out, res = k3
    assert res.passed is True
    lay = res.report["layout"]
    assert (lay["tp"], lay["moe_ep"], lay["redundant_experts"], lay["world"]) == (8, 8, 64, 8)
    man = read_manifest_doc(out)
    placed = man["layout"]["experts"]["layers"]
    assert len(placed) == LAYERS - 1  # the first layer is dense
    for lp in placed.values() if isinstance(placed, dict) else placed:
        slots = [e for rank in lp["ep_rank_experts"] for e in rank]
        assert len(slots) == EXPERTS + 64 and set(slots) == set(range(EXPERTS))


def test_plan_equals_the_stream_per_rank(k3):
    src, out, _ = k3
    listed, stored = _manifest_bytes(out)
    assert listed == stored and len(listed) == 8
    recipe = load_recipe("kimi-k3-day0", ONE_STAGE)
    plan = plan_memory(src=src, recipe=recipe, expert_load=out / "routing_counts.json",
                       search=False)  # fmt: skip
    assert [r.weights for r in plan.ranks] == listed


def test_each_rank_opens_alone(k3):
    _, out, _ = k3
    names = set()
    for r in range(8):
        reader = open_stream(out, ranks=[r]).rank(r)
        names.update(reader.names())
    assert len(list(reader.units())) == len(reader.unit_names())  # hashes checked
    experts = {n for n in names if ".experts." in n and "shared" not in n}
    assert len({n.split(".experts.")[1].split(".")[0] for n in experts}) == EXPERTS
