"""Per-tensor records are held for the unit (and the rank) being written, not for every
rank at once: the shard plan builds a unit's tensor records when asked for and keeps only
the last few; the manifest is rendered and written one rank at a time; convert's verify
reads the source's tensor table once (the reference is the checkpoint convert opened).

Every layout is still planned in full up front (a split error is raised before a byte
is written), and a unit's records built again equal the first ones."""

from __future__ import annotations

import copy
import gc
import json
import weakref
from pathlib import Path

import pytest

import k3convert.shard.writer as shard_writer
import k3convert.verify.run as verify_run
import k3convert.verify.summary as verify_summary
from k3convert.checkpoint import open_checkpoint
from k3convert.layout import Layout
from k3convert.pipeline.convert import convert
from k3convert.recipe import parse_recipe
from k3convert.shard import shard
from k3convert.shard.plan import TensorPlan, _Records, build_plan
from k3convert.stream import read_manifest_doc, write_manifest_doc
from k3convert.stream.format import SplitError
from k3convert.synth import synthesize
from tests.test_shard_support import tree_hashes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("k3rec") / "m"
    synthesize(
        config="kimi-k3",
        out=d,
        tiny=True,
        seed=3,
        overrides={"layers": 3, "experts": 16, "topk": 4},
    )
    return d


def _live_records() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is TensorPlan)


def test_a_plan_keeps_the_records_of_a_few_units(k3, monkeypatch):
    monkeypatch.setattr(_Records, "CACHED", 2)
    before = _live_records()
    plan = build_plan(open_checkpoint(k3), Layout(tp=4, pp=2, moe_tp=1, moe_ep=4))
    held = _live_records() - before
    counts = sorted((up.count for up in plan.units), reverse=True)
    assert len(plan.units) == 4 * 6  # tp 4 x (embed, vision, 3 layers, head) over 2 stages
    assert sum(counts) > 3 * sum(counts[:2])  # every rank's records would be far more
    assert 0 < held <= sum(counts[:2])
    # asking for every unit again keeps no more than that either
    for up in plan.units:
        assert len(up.tensors) == up.count
    assert _live_records() - before <= sum(counts[:2])


def test_records_built_again_equal_the_first(k3, monkeypatch):
    monkeypatch.setattr(_Records, "CACHED", 1)
    load = {1: list(range(16)), 2: [1] * 16}
    lay = Layout(tp=2, pp=2, moe_tp=1, moe_ep=2)
    plan = build_plan(open_checkpoint(k3), lay, redundant_experts=2, expert_load=load)
    first = [copy.deepcopy([t.entry for t in up.tensors]) for up in plan.units]
    for up, entries in zip(reversed(plan.units), reversed(first), strict=True):
        assert [t.entry for t in up.tensors] == entries
        assert up.header()[2] == up.nbytes and len(entries) == up.count
    # an expert held by two EP ranks (redundant copy) is in both ranks' units
    placed = plan.experts["layers"]["1"]["expert_ep_ranks"]
    hot = next(e for e, ranks in enumerate(placed) if len(ranks) == 2)
    stage_units = [up for up in plan.units if up.name == "layer.1"]
    holders = {up.tp for up in stage_units
               if any(t.entry["expert"] == hot for t in up.tensors)}  # fmt: skip
    assert holders == set(placed[hot])


def test_a_split_error_is_raised_when_planning(k3):
    with pytest.raises(SplitError, match="heads"):
        build_plan(open_checkpoint(k3), Layout(tp=5))


def test_the_manifest_is_written_one_rank_at_a_time(k3, tmp_path, monkeypatch):
    real = shard_writer._rank_units
    alive: list[weakref.ref] = []

    class Entries(list):
        pass

    def one_rank(plan, r, results, compress):
        gc.collect()
        assert all(ref() is None for ref in alive), "an earlier rank's entries are still held"
        got = Entries(real(plan, r, results, compress))
        alive.append(weakref.ref(got))
        return got

    monkeypatch.setattr(shard_writer, "_rank_units", one_rank)
    out = shard(src=k3, out=tmp_path / "s", tp=2, pp=2, ep=2, progress=False).out
    assert len(alive) == 4
    monkeypatch.undo()
    # the same bytes as the whole document written at once
    before = tree_hashes(out)
    write_manifest_doc(out, read_manifest_doc(out))
    assert tree_hashes(out) == before


def test_convert_verifies_against_the_checkpoint_it_opened(k3, tmp_path, monkeypatch):
    """...and lets the quantization's preparation (per-tensor rows, calibration) go
    before verify runs."""
    import k3convert.pipeline.convert as convert_mod

    opened: list[Path] = []
    preps: list[weakref.ref] = []
    summary, run_verify = convert_mod.quantize_summary, convert_mod._run_verify

    def summarise(prep, *a, **kw):
        preps.append(weakref.ref(prep))
        return summary(prep, *a, **kw)

    def verify(*a, **kw):
        gc.collect()
        assert preps and all(ref() is None for ref in preps), "the preparation is still held"
        return run_verify(*a, **kw)

    monkeypatch.setattr(convert_mod, "quantize_summary", summarise)
    monkeypatch.setattr(convert_mod, "_run_verify", verify)

    def counting(path, *a, **kw):
        opened.append(Path(path))
        return open_checkpoint(path, *a, **kw)

    monkeypatch.setattr(verify_run, "open_checkpoint", counting)
    monkeypatch.setattr(verify_summary, "open_checkpoint", counting)
    recipe = parse_recipe({
        "quantize": {"rules": [{"roles": ["attention"], "scheme": "fp8-dynamic"}]},
        "layout": {"tp": 2},
        "verify": {"samples": 1, "seq_len": 8},
    })  # fmt: skip
    res = convert(src=k3, out=tmp_path / "c", recipe=recipe, progress=False)
    assert res.passed is True
    assert [p for p in opened if p.resolve() == k3.resolve()] == []


def test_a_loaded_rank_shares_its_repeated_entry_values(k3, tmp_path):
    out = shard(src=k3, out=tmp_path / "s", tp=2, ep=2, progress=False).out
    from k3convert.stream import open_stream

    st = open_stream(out, ranks=[1])
    units = st.rank(1).unit_entries
    plain = json.loads((out / "rank00001/units.json").read_text())["units"]
    # the same values (the reader adds its own _version key), fewer objects
    assert [{k: v for k, v in u.items() if k != "_version"} for u in units] == plain
    experts = [e for u in units for e in u["tensors"] if e["expert"] is not None]
    assert len(experts) > 10
    e0 = experts[0]
    same = [e for e in experts if (e["part"], e["kind"]) == (e0["part"], e0["kind"])]
    assert len(same) > 2 and all(e["shape"] is same[0]["shape"] for e in same)
    assert all(e["quant"] is same[0]["quant"] for e in same)
    assert len({id(e["encoding"]) for e in experts}) == 1


def test_parsed_unit_headers_are_kept_within_a_tensor_budget(k3, tmp_path, monkeypatch):
    from k3convert.stream import open_stream, unit_loader

    out = shard(src=k3, out=tmp_path / "s", tp=2, ep=2, progress=False).out
    monkeypatch.setattr(unit_loader, "_PARSED", unit_loader.OrderedDict())
    monkeypatch.setattr(unit_loader, "_PARSED_TENSORS", 40)
    st = open_stream(out)
    sizes = []
    for r in range(st.world):
        for u in st.rank(r).units(prefetch=0):
            sizes.append(len(u.tensors))
    held = [len(v[1][1]) for v in unit_loader._PARSED.values()]
    assert max(sizes) > 40 and len(sizes) > len(held) >= 1
    assert sum(held) <= 40 or len(held) == 1
    # a unit read again after its header was dropped parses the same
    again = [len(u.tensors) for r in range(st.world) for u in st.rank(r).units(prefetch=0)]
    assert again == sizes


def test_replicated_bytes_count_the_tied_head_copy(model_factory):
    """The head unit holds the tied embedding again: counted as replicated (the plan
    counts replication per unit, and across units for the tied embedding only)."""
    ck = open_checkpoint(model_factory("qwen3", tie_word_embeddings=True))
    embed = next(n for n in ck.names() if n.endswith("embed_tokens.weight"))
    assert build_plan(ck, Layout()).replicated_bytes() == ck.meta(embed).nbytes
    assert build_plan(ck, Layout(tp=2, pp=2)).replicated_bytes() > ck.meta(embed).nbytes
