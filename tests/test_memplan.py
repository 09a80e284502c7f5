"""``k3convert plan``: hand-computed caches and states, per-rank weights against what
``shard`` really writes (its manifest, and the unit files read back by the safetensors
library), the layout search, sizes, devices and the command line."""

from __future__ import annotations

import importlib.util
import json

import pytest
from safetensors import safe_open

from k3convert.arch import resolve
from k3convert.checkpoint import open_checkpoint
from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.layout import Layout
from k3convert.memplan import (
    DEVICES,
    LayerModel,
    WeightModel,
    Workload,
    build_plan_bytes,
    checkpoint_tensors,
    config_tensors,
    device_budget,
    plan_memory,
    quantized_tensors,
)
from k3convert.memplan.plan import STAGES
from k3convert.memplan.render import plan_figure
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.recipe import load_recipe
from k3convert.shard import shard
from k3convert.stream import read_manifest_doc
from k3convert.synth import preset_config, synthesize
from k3convert.units import parse_size, parse_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: bytes per element of the safetensors dtype names a manifest records
ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}  # fmt: skip
K2_128K = 61 * 576 * 131072 * 2
K2_1M = 61 * 576 * 1048576 * 2
K3_MLA_1M = 24 * 576 * 1048576 * 2
K3_KDA_TP1 = 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
K3_KDA_TP8 = 69 * (12 * 128 * 128 * 4 + 3 * 1536 * 3 * 2)
#: packed int4 experts with zero points, FP8 per-channel attention, int8 dense MLPs
MIXED = """quantize:
  rules:
    - {roles: [experts], scheme: int4-g32-asym}
    - {roles: [attention], scheme: fp8-dynamic}
    - {roles: [dense_mlp, shared_experts], scheme: w8a8}
"""


# -- fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny synth kimi-k25 and kimi-k3, a mixed quantization of the first (:data:`MIXED`),
    and tp2 pp2 ep2 shards of all three."""
    root = tmp_path_factory.mktemp("memplan")
    out = {}
    for preset in ("kimi-k25", "kimi-k3"):
        synthesize(config=preset, out=root / preset, tiny=True)
        out[preset] = root / preset
    (root / "mixed.yaml").write_text(MIXED)
    quantize(src=out["kimi-k25"], out=root / "k25-mixed", recipe=root / "mixed.yaml")
    out["k25-mixed"] = root / "k25-mixed"
    for name in list(out):
        shard(src=out[name], out=root / f"{name}.tp2pp2ep2", tp=2, pp=2, ep=2)
        out[f"{name}.stream"] = root / f"{name}.tp2pp2ep2"
    return out


def _manifest_bytes(stream) -> tuple[list[int], list[int]]:
    """Per rank: the tensor bytes the manifest lists, and those the unit files hold
    (read back with safetensors, alignment padding tensors left out)."""
    m = read_manifest_doc(stream)
    listed, stored = [], []
    for r in m["ranks"]:
        a = b = 0
        for u in r["units"]:
            a += sum(ST_BYTES[t["dtype"]] * _prod(t["shape"]) for t in u["tensors"])
            with safe_open(str(stream / u["file"]), "pt") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if not k.startswith("__pad__"):
                        t = f.get_slice(k)
                        b += ST_BYTES[t.get_dtype()] * _prod(t.get_shape())
        listed.append(a)
        stored.append(b)
    return listed, stored


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# -- parsers and devices -----------------------------------------------------------------
def test_sizes_and_tokens():
    assert parse_size("141GiB") == 141 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size(" 2000 ") == 2000 and parse_size("512MiB") == 512 * 2**20
    for bad in ("12XB", "", "GB", "-1GB", "0GB", "1G"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    assert parse_tokens("128k") == 131072 and parse_tokens("1M") == 1048576
    assert parse_tokens("131072") == 131072 and parse_tokens("1.5k") == 1536
    for bad in ("-5", "0", "0.3k", "1G", "abc"):
        with pytest.raises(ConfigError):
            parse_tokens(bad)


def test_device_presets():
    # the vendors' decimal GB
    assert DEVICES == {
        "a100": 80e9, "h100": 80e9, "h200": 141e9, "b200": 180e9, "mi300x": 192e9,
        "mi325x": 256e9, "mtt-s5000": 80e9,
    }  # fmt: skip
    n, label = device_budget(None, "H200")
    assert n == 141_000_000_000 and "141 GB" in label
    assert round(n / 2**30, 2) == 131.32  # GiB, as the table prints
    assert device_budget("140GiB", None)[0] == 140 * 2**30
    assert device_budget(None, None) == (None, "")
    with pytest.raises(ConfigError, match="known devices"):
        device_budget(None, "a100x")
    with pytest.raises(ConfigError, match="not both"):
        device_budget("80GB", "h100")


# -- KV cache and KDA state, by hand -------------------------------------------------------
def _layers(preset: str) -> LayerModel:
    return LayerModel(resolve(preset_config(preset))[1])


def test_mla_cache_kimi_k2():
    L = _layers("kimi-k2")
    assert L.kinds == ["mla"] * 61
    for ctx, want in ((131072, K2_128K), (1048576, K2_1M)):
        for tp in (1, 8):  # the latent is replicated on every TP rank
            w = Workload(context=ctx)
            assert sum(L.kv_cache(i, tp, w) for i in range(61)) == want
            w8 = Workload(context=ctx, kv_dtype="fp8")
            assert sum(L.kv_cache(i, tp, w8) for i in range(61)) == want // 2
    w = Workload(context=131072, batch=3)
    assert sum(L.kv_cache(i, 1, w) for i in range(61)) == 3 * K2_128K
    assert sum(L.kda_state(i, 1, w) for i in range(61)) == 0


def test_kimi_k3_cache_and_state_at_1m():
    L = _layers("kimi-k3")
    assert L.kinds.count("mla") == 24 and L.kinds.count("kda") == 69
    w = Workload(context=1048576)
    assert sum(L.kv_cache(i, 1, w) for i in range(93)) == K3_MLA_1M
    assert sum(L.kda_state(i, 1, w) for i in range(93)) == K3_KDA_TP1 == 449_372_160
    assert sum(L.kv_cache(i, 8, w) for i in range(93)) == K3_MLA_1M
    assert sum(L.kda_state(i, 8, w) for i in range(93)) == K3_KDA_TP8 == 56_171_520
    # fp8 halves the latent cache, not the float32 recurrent state; nor does the context
    w8 = Workload(context=2048, kv_dtype="fp8")
    assert sum(L.kv_cache(i, 8, w8) for i in range(93)) == 24 * 576 * 2048
    assert sum(L.kda_state(i, 8, w8) for i in range(93)) == K3_KDA_TP8


def test_gqa_cache_and_activation_estimate_llama():
    L = _layers("llama3-8b")  # 32 layers, 32 heads, 8 KV heads of 128, hidden 4096
    w = Workload(context=8192)
    assert sum(L.kv_cache(i, 1, w) for i in range(32)) == 2**30
    assert sum(L.kv_cache(i, 4, w) for i in range(32)) == 2**28  # 2 KV heads per rank
    assert sum(L.kv_cache(i, 16, w) for i in range(32)) == 2**27  # 1, replicated
    # the documented estimate: 3*T*h*a + max(attention, 3*T*I*a), T = 8192 tokens
    resid, mlp = 3 * 8192 * 4096 * 2, 3 * 8192 * 2 * 14336
    assert mlp > 8192 * 2 * (2 * 32 * 128 + 2 * 8 * 128)  # the MLP block is the peak
    assert L.activations(0, 1, 1, Workload(context=131072)) == resid + mlp == 905_969_664
    assert L.activations(0, 1, 1, Workload(context=100)) == (resid + mlp) * 100 // 8192
    assert L.logits(w) == 128256 * 4
    with pytest.raises(ConfigError, match=r"legal tp: \[1, 2, 4, 8, 16, 32\]"):
        L.check_tp(3)


def test_kimi_k3_plan_at_tp8_two_stages(tmp_path):
    raw = preset_config("kimi-k3")  # full-size attention; 32 experts a layer keep it quick
    raw["text_config"]["num_experts"] = 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    p = plan_memory(src=tmp_path, tp=8, pp=2, ep=8, context="1M", device="h200", search=False)
    assert p.layout.world == 16 and p.budget == 141 * 10**9
    (a, b), (c, d) = p.stages
    assert (a, b, d) == (0, c, 93) and 0 < b < 93
    L = _layers("kimi-k3")
    w = Workload(context=1048576)
    for r in p.ranks:  # a stage holds only its own layers' cache and state
        lo, hi = p.stages[r.pp_rank]
        assert r.kv_cache == sum(L.kv_cache(i, 8, w) for i in range(lo, hi))
        assert r.kda_state == sum(L.kda_state(i, 8, w) for i in range(lo, hi))
    assert sum({r.pp_rank: r.kv_cache for r in p.ranks}.values()) == K3_MLA_1M
    assert sum({r.pp_rank: r.kda_state for r in p.ranks}.values()) == K3_KDA_TP8
    # both stages peak in an MoE layer; the last adds the float32 logits (vocab 163840)
    assert p.ranks[-1].activations - p.ranks[0].activations == 163840 * 4
    assert p.fits is True and p.over == [] and p.peak < 141 * 10**9


# -- weights per rank against shard ---------------------------------------------------------
@pytest.mark.parametrize("name", ["kimi-k25", "kimi-k3", "k25-mixed"])
def test_weights_equal_a_written_shard(tiny, name):
    listed, stored = _manifest_bytes(tiny[f"{name}.stream"])
    assert listed == stored
    t = checkpoint_tensors(tiny[name])
    got = WeightModel(t).per_rank(Layout(tp=2, pp=2, moe_ep=2))[0]
    assert got == listed
    p = plan_memory(src=tiny[name], tp=2, pp=2, ep=2, search=False)
    assert [r.weights for r in p.ranks] == listed


def test_config_alone_and_planned_quantization_equal_the_shard(tiny):
    src = tiny["kimi-k25"]
    listed, _ = _manifest_bytes(tiny["k25-mixed.stream"])
    # quantize's own rules applied to the source's metadata, no weights read
    rec = load_recipe(tiny["kimi-k25"].parent / "mixed.yaml")
    q = quantized_tensors(checkpoint_tensors(src), recipe=rec)
    assert WeightModel(q).per_rank(Layout(tp=2, pp=2, moe_ep=2))[0] == listed
    # a --scheme: one rank holds what quantize's dry run says it would write
    for scheme in ("w8a8", "fp8-dynamic"):
        _, qplan = plan_quantization(src=src, scheme=scheme)
        p = plan_memory(src=src, scheme=scheme, search=False)
        assert p.ranks[0].weights == qplan.totals()[1]
    # a config.json alone: the tensors synth writes for it
    for name in ("kimi-k25", "kimi-k3"):
        cfg = json.loads((tiny[name] / "config.json").read_text())
        c = config_tensors(cfg, "config.json")
        want, _ = _manifest_bytes(tiny[f"{name}.stream"])
        assert WeightModel(c).per_rank(Layout(tp=2, pp=2, moe_ep=2))[0] == want


@pytest.mark.parametrize("name", ["kimi-k25", "kimi-k3", "k25-mixed"])
def test_weights_equal_build_plan_over_layouts(tiny, name):
    t = checkpoint_tensors(tiny[name])
    wm = WeightModel(t)
    layouts = [(1, 1, 1), (2, 1, 2), (4, 2, 4), (4, 1, 4), (2, 3, 2), (1, 2, 1)]
    if name != "kimi-k3":  # moe_tp 2 would cut the tiny K3's 32-column MXFP4 groups
        layouts += [(4, 2, 2), (2, 2, 1), (2, 3, 1)]
    for tp, pp, ep in layouts:
        lay = Layout(tp=tp, pp=pp, moe_ep=ep)
        assert wm.per_rank(lay)[0] == build_plan_bytes(t, lay), (tp, pp, ep)
    # explicit stages, routing counts and redundant copies, as shard places them
    load = {L: [float(e) for e in range(8)] for L in {r.layer for r in t.roles if r.expert}}
    lay = Layout(tp=4, pp=2, moe_ep=4)
    n = t.cfg.num_layers
    kw = dict(pp_layers=[1, n - 1], load=load, redundant=4)
    want = build_plan_bytes(t, lay, pp_layers=[1, n - 1], expert_load=load, redundant_experts=4)
    assert wm.per_rank(lay, **kw)[0] == want
    # redundant copies without counts: the planner's uniform counts, as shard with them
    even = {L: [1.0] * 8 for L in load}
    want = build_plan_bytes(t, lay, expert_load=even, redundant_experts=4)
    assert wm.per_rank(lay, redundant=4)[0] == want


# -- the layout search -----------------------------------------------------------------------
def test_search_lists_layouts_that_fit_by_device_count(tiny):
    src = tiny["kimi-k25"]
    kw = dict(context=4096, prefill_chunk=64)
    base = plan_memory(src=src, search=False, **kw)
    budget = int(base.peak * 0.6)  # one device is not enough
    stages: list[str] = []
    p = plan_memory(src=src, device_mem=budget, top=4, on_stage=stages.append, **kw)
    assert stages == [STAGES[0], STAGES[2], STAGES[3]]  # progress: no quantization here
    assert p.over == [0] and p.search
    if importlib.util.find_spec("matplotlib") is not None:  # the chart says what is over
        import matplotlib.pyplot as plt

        fig = plan_figure(p)
        ax = fig.axes[0]
        labels = ax.get_legend_handles_labels()[1]
        plt.close(fig)
        assert "over budget (1 rank(s))" in labels and "free" not in labels, labels
        assert f"; device {p.device};" in ax.get_title()
    devices = [f.devices for f in p.search]
    assert devices == sorted(devices) and len(p.search) == 4
    for f in p.search:  # every listed layout really fits, with the peak reported
        q = plan_memory(src=src, tp=f.tp, pp=f.pp, ep=f.ep, search=False, **kw)
        assert q.peak == f.peak <= budget
    smallest = devices[0]
    for tp in (1, 2, 4):  # and nothing with fewer devices does
        for pp in range(1, smallest // tp + 1):
            for ep in (e for e in (1, 2, 4) if tp % e == 0):
                if tp * pp < smallest:
                    q = plan_memory(src=src, tp=tp, pp=pp, ep=ep, search=False, **kw)
                    assert q.peak > budget, (tp, pp, ep)
    none = plan_memory(src=src, device_mem="1KB", **kw)
    assert none.search == [] and "no layout fits" in none.search_note
    assert "no layout fits" in none.table()


# -- recipe ----------------------------------------------------------------------------------
def test_recipe_layout_and_quantize_are_defaults(tiny, tmp_path, capsys):
    r = tmp_path / "r.yaml"
    r.write_text(
        f"source: {{path: {tiny['kimi-k25']}}}\nlayout: {{tp: 2, pp: 2, moe_ep: 2}}\n" + MIXED
    )
    listed, _ = _manifest_bytes(tiny["k25-mixed.stream"])
    p = plan_memory(recipe=load_recipe(r), search=False)
    assert (p.layout.tp, p.layout.pp, p.layout.moe_ep) == (2, 2, 2)
    assert [x.weights for x in p.ranks] == listed and "recipe" in p.model["weights_from"]
    p1 = plan_memory(recipe=load_recipe(r), tp=1, pp=1, ep=1, search=False)  # explicit flags win
    ck = open_checkpoint(tiny["k25-mixed"])  # what quantize wrote
    assert p1.layout.world == 1 and p1.ranks[0].weights == sum(
        ck.meta(n).nbytes for n in ck.names()
    )
    rc, out, err = _run(capsys, "plan", "--recipe", r, "--device", "h100")  # no SRC
    assert rc == 0 and "tp 2 x pp 2 = 4 rank(s)" in out and "recipe" in out, err
    with pytest.raises(ConfigError, match="model_type"):
        r.write_text(f"source: {{path: {tiny['kimi-k25']}, model_type: llama}}\n")
        plan_memory(recipe=load_recipe(r), search=False)


# -- command line ------------------------------------------------------------------------------
def test_cli_table_json_plot_and_exit_codes(tiny, tmp_path, capsys):
    src = tiny["kimi-k3"]
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    args = [src, "--tp", 2, "--pp", 2, "--ep", 2, "--context", "128k", "--device-mem", "1MiB"]
    plot = [] if _no_matplotlib() else ["--plot", png]
    rc, out, err = _run(capsys, "plan", *args, "--json", js, *plot)
    assert rc == 0, err
    assert "rank(s)" in out and "FLAG" in out and "OVER" in out and "kda state" in out
    d = json.loads(js.read_text())
    assert d["format"] == "k3convert-plan-v1" and d["budget_bytes"] == 2**20
    assert set(d) >= {"source", "model", "layout", "workload", "stages", "ranks", "totals",
                      "peak_bytes", "fits", "over_ranks", "search", "notes"}  # fmt: skip
    assert d["layout"] == {"tp": 2, "pp": 2, "moe_tp": 1, "moe_ep": 2, "world": 4,
                           "redundant_experts": 0}  # fmt: skip
    assert d["workload"]["context"] == 131072 and d["fits"] is False
    for r in d["ranks"]:
        assert set(r) == {"rank", "pp_rank", "tp_rank", "ep_rank", "weights", "kv_cache",
                          "kda_state", "activations", "total", "free", "over"}  # fmt: skip
        assert r["total"] == r["weights"] + r["kv_cache"] + r["kda_state"] + r["activations"]
        assert all(isinstance(r[k], int) for k in ("weights", "kv_cache", "total"))
    assert d["ranks"][0]["weights"] == _manifest_bytes(tiny["kimi-k3.stream"])[0][0]
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = _run(capsys, "plan", *args, "--fail-if-over")
    assert rc == 1 and "FAIL" in err
    rc, out, _ = _run(capsys, "plan", src, "--device", "h200", "--fail-if-over")
    assert rc == 0 and "fits" in out


def _no_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is None


@pytest.mark.parametrize(
    "args, words",
    [
        (["--device", "a100x"], "known devices"),
        (["--tp", "3"], "does not divide"),
        (["--tp", "4", "--ep", "3"], "must divide tp"),
        (["--context", "-5"], "positive"),
        (["--device-mem", "12XB"], "not a size"),
        (["--kv-dtype", "int4"], "kv-dtype"),
        (["--pp", "9"], "exceeds"),
        (["--redundant-experts", "3", "--ep", "2", "--tp", "2"], "spread evenly"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tiny, capsys, args, words):
    rc, _, err = _run(capsys, "plan", tiny["kimi-k25"], *args)
    assert rc == 2 and words in err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_missing_source_and_matplotlib(tiny, capsys, monkeypatch, tmp_path):
    rc, _, err = _run(capsys, "plan")
    assert rc == 2 and "give SRC" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, "plan", tmp_path / "nothing-here")
    assert rc == 2 and "neither" in err
    rc, _, err = _run(capsys, "plan", tiny["kimi-k25.stream"])
    assert rc == 2 and "stream directory" in err and err.count("\n") == 1
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    rc, _, err = _run(capsys, "plan", tiny["kimi-k25"], "--plot", tmp_path / "x.png")
    assert rc == 2 and "matplotlib" in err and err.count("\n") == 1
