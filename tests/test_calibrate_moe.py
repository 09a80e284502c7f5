"""MoE calibration: routing counts (``OUT/routing_counts.json`` -> ``shard --expert-load``)
checked against transformers' own routers, and the all-experts coverage mode."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path

import pytest
import torch

from k3convert.calibrate.data import build_calibration_set
from k3convert.calibrate.sequential import (
    ExpertFallbackWarning,
    SequentialOptions,
    calibrate_sequential,
)
from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.pipeline.quantize import plan_quantization
from k3convert.stream import read_manifest_doc
from tests.models import build_model, save_model
from tests.test_calibrate_sequential import _ids_file, k3_calibration

SAMPLES, SEQ, BATCH = 8, 24, 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("calmoe")
    return root, _ids_file(root / "ids.jsonl")


def _transformers_counts(model, calib, moe_layers, n_exp: int) -> dict[int, list[int]]:
    """Real tokens each expert gets from transformers' router, per MoE layer."""
    got: dict[int, list] = {L: [] for L in moe_layers}
    hooks = [
        model.model.layers[L].mlp.experts.register_forward_pre_hook(
            lambda mod, args, L=L: got[L].append(args[1].clone())
        )
        for L in moe_layers
    ]
    valid = []
    with torch.no_grad():
        for k in range(0, calib.input_ids.shape[0], BATCH):
            m = calib.attention_mask[k : k + BATCH]
            model(input_ids=calib.input_ids[k : k + BATCH], attention_mask=m)
            valid.append(m.reshape(-1).bool())
    for h in hooks:
        h.remove()
    out = {}
    for L in moe_layers:
        idx = torch.cat([i[v] for i, v in zip(got[L], valid, strict=True)])
        out[L] = torch.bincount(idx.reshape(-1), minlength=n_exp).tolist()
    return out


def _cli(argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main([str(a) for a in argv])
    return rc, buf.getvalue()


def test_routing_counts_match_transformers_and_feed_shard(work):
    """Layer 0 kept in float: both MoE layers see transformers' own hidden states, so the
    written counts must equal Qwen3-MoE's router choices; shard then replicates the
    hottest experts (picked up from SRC/routing_counts.json)."""
    root, data = work
    src = save_model("qwen3_moe", root / "qwen3moe")
    out = root / "q-fp8"
    rc, text = _cli(["quantize", src, out, "--scheme", "fp8", "--calibrate", "--algorithm",
                     "static", "--dataset", data, "--num-samples", SAMPLES, "--seq-len", SEQ,
                     "--keep", r"re:model\.layers\.0\..*"])  # fmt: skip
    assert rc == 0, text
    path = out / "routing_counts.json"
    assert f"routing counts of 2 MoE layer(s): {path}" in text
    doc = json.loads(path.read_text())
    calib = build_calibration_set(src, data, num_samples=SAMPLES, seq_len=SEQ, seed=0)
    assert doc["dataset_fingerprint"] == calib.fingerprint
    tokens = int(calib.attention_mask.sum())
    assert doc["tokens"] == tokens and doc["top_k"] == 2
    want = _transformers_counts(build_model("qwen3_moe"), calib, (0, 1), 8)
    assert doc["layers"] == {str(L): c for L, c in want.items()}
    assert all(sum(c) == 2 * tokens for c in want.values())
    # shard: --redundant-experts alone picks the file up; the hottest experts get copies
    rc, text = _cli(["shard", out, root / "st", "--tp", 2, "--ep", 2, "--redundant-experts", 2])
    assert rc == 0, text
    assert f"expert load: {path}" in text
    man = read_manifest_doc(root / "st")
    ex = man["layout"]["experts"]
    assert ex["policy"] == "load" and ex["redundant"] == 2
    for L, counts in want.items():
        lay = ex["layers"][str(L)]
        assert lay["load"] == [float(c) for c in counts]
        copies = [len(r) for r in lay["expert_ep_ranks"]]
        assert sum(copies) == 10 and all(len(b) == 5 for b in lay["ep_rank_experts"])
        # the documented rule: each extra copy to the highest load per copy
        n = [1] * 8
        for _ in range(2):
            e = max(range(8), key=lambda j: (counts[j] / n[j], -j))
            n[e] += 1
        assert [c > 1 for c in copies] == [c > 1 for c in n], (L, counts, copies)
        hottest = max(range(8), key=lambda j: counts[j])
        assert copies[hottest] == 2 or counts.count(counts[hottest]) > 1
    # the explicit flag gives the same placement; no file and no flag: contiguous refused
    rc, _ = _cli(["shard", out, root / "st2", "--tp", 2, "--ep", 2, "--redundant-experts", 2,
                  "--expert-load", path])  # fmt: skip
    man2 = read_manifest_doc(root / "st2")
    assert rc == 0 and man2["layout"]["experts"] == ex
    with pytest.raises(ConfigError, match="redundant"):
        from k3convert.shard import shard

        shard(src=src, out=root / "st3", tp=2, ep=2, redundant_experts=2, progress=False)


def _biased_dsv3(path: Path) -> Path:
    """DeepSeek-V3 whose correction bias sends every token to experts 0 and 1."""
    model = build_model("deepseek_v3")
    with torch.no_grad():
        for L in (1, 2):
            b = model.model.layers[L].mlp.gate.e_score_correction_bias
            b.zero_()
            b[:2] = 10.0
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def starved(work):
    root, data = work
    src = _biased_dsv3(root / "dsv3-biased")
    calib = build_calibration_set(
        src, data, num_samples=SAMPLES, seq_len=SEQ, seed=0, packing=False, min_len=8
    )
    return root, src, calib


def _calibrate(root, src, calib, scheme, algorithm, tag, all_experts, observer=None):
    ckpt, plan = plan_quantization(src=src, scheme=scheme)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = calibrate_sequential(
            ckpt, plan, calib, algorithm=algorithm,
            options=SequentialOptions(batch_size=BATCH, moe_all_experts=all_experts),
            journal=root / f"j-{tag}", observer=observer,
        )  # fmt: skip
    warned = {str(w.message).split("'")[1] for w in caught
              if issubclass(w.category, ExpertFallbackWarning)}  # fmt: skip
    return ckpt, plan, res, warned


def _recorder(store: dict, layer: int):
    def obs(i, name, x, m):
        if i == layer and ".experts." not in name:
            store.setdefault(name, []).append(x.detach().clone())

    return obs


@pytest.mark.parametrize("algorithm,scheme", [("static", "fp8"), ("gptq", "w8a8")])
def test_all_experts_mode_no_starved_expert(starved, algorithm, scheme):
    root, src, calib = starved
    tokens = int(calib.attention_mask.sum())
    nxt_off: dict = {}
    nxt_on: dict = {}
    _, plan, off, warned = _calibrate(root, src, calib, scheme, algorithm, f"{algorithm}-off",
                                      False, _recorder(nxt_off, 2))  # fmt: skip
    _, _, on, warned_on = _calibrate(root, src, calib, scheme, algorithm, f"{algorithm}-on",
                                     True, _recorder(nxt_on, 2))  # fmt: skip
    experts = [r for r in plan.quantized if r.role.expert is not None]
    starved_rows = {r.name for r in experts if r.role.expert >= 2}
    assert len(starved_rows) == 2 * 6 * 3
    # without: experts 2..7 saw nothing, fell back with a warning and are listed
    assert set(off.fallbacks) == starved_rows == warned
    assert not on.fallbacks and not warned_on
    # routed counts in both modes: all tokens to experts 0 and 1
    for res in (off, on):
        assert res.routing_counts == {1: [tokens, tokens] + [0] * 6, 2: [tokens, tokens] + [0] * 6}
        for r in experts:
            assert res.expert_tokens[r.name] == (tokens if r.role.expert < 2 else 0), r.name
    if algorithm == "static":
        for res in (off, on):
            for r in experts:
                s = res.input_scales[r.module]
                assert torch.isfinite(torch.tensor(s)) and s > 0, r.name
        # all experts' gate / up inputs are the MoE input: the shared expert's own scale
        for L in (1, 2):
            shared = on.input_scales[f"model.layers.{L}.mlp.shared_experts.gate_proj"]
            for e in range(8):
                for p in ("gate_proj", "up_proj"):
                    mod = f"model.layers.{L}.mlp.experts.{e}.{p}"
                    assert on.input_scales[mod] == pytest.approx(shared, rel=1e-6), mod
        # the next layer's inputs are the routed ones (same with and without the mode)
        assert nxt_off and nxt_off.keys() == nxt_on.keys()
        for n in nxt_off:
            for a, b in zip(nxt_off[n], nxt_on[n], strict=True):
                assert torch.equal(a, b), n
    else:  # GPTQ parts for every expert with the mode
        for r in experts:
            assert on.weight_parts(r.name) is not None, r.name
            sc = on.weight_parts(r.name)["weight_scale"]
            assert bool(torch.isfinite(sc).all()) and bool((sc > 0).all()), r.name


def test_all_experts_option_checked_and_cli_needs_calibrate(work, capsys):
    with pytest.raises(ConfigError, match="moe_all_experts"):
        SequentialOptions(moe_all_experts="yes").check()
    root, _ = work
    rc = main(["quantize", str(root / "nope"), str(root / "o"), "--scheme", "fp8",
               "--moe-all-experts"])  # fmt: skip
    assert rc == 2
    assert "--moe-all-experts" in capsys.readouterr().err


# -- observers ---------------------------------------------------------------------------
def _heavy(seed: int, rows: int = 4096, cols: int = 64) -> torch.Tensor:
    """Student-t (2 degrees of freedom) activations with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(2.0)
    torch.manual_seed(seed)
    x = t.sample((rows, cols)).float()
    x[:, :2] *= 1 + 20 * torch.rand(2, generator=g)
    return x


def _brute_mse(x: torch.Tensor, amax: float, kind: str, bits: int) -> float:
    """Direct: every ratio's squared error on the whole tensor (float64), argmin."""
    qmax = 448.0 if kind == "float" else float(2 ** (bits - 1) - 1)
    best, arg = None, None
    for i in range(80):
        r = 1.0 - i / 100
        s = r * amax / qmax
        if kind == "float":
            q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        else:
            q = torch.round(x / s).clamp(-qmax - 1, qmax) * s
        e = float((q.double() - x.double()).square().sum())
        if best is None or e < best:
            best, arg = e, r * amax
    return arg


def test_observers_against_direct_computation():
    import numpy as np

    from k3convert.calibrate.observers import (
        MinMaxObserver,
        MSEObserver,
        PercentileObserver,
    )

    batches = [_heavy(s, rows=1000 + 37 * s) for s in range(5)]
    allx = torch.cat(batches)
    amax = float(allx.abs().max())
    for p in (99.99, 99.9, 97.5, 50.0, 100.0):
        ob = PercentileObserver(p, capacity=allx.numel() + 12345)  # a bound, not the count
        for b in batches:
            ob.update(b)
        want = float(np.percentile(np.abs(allx.numpy()).astype(np.float64), p))
        assert ob.clip() == pytest.approx(want, rel=1e-12, abs=0), p
        assert ob.keep < allx.numel() // 10 or p == 50.0
    mm = MinMaxObserver()
    for b in batches:
        mm.update(b)
    assert mm.clip() == amax
    pct = PercentileObserver(99.99, capacity=allx.numel())
    for b in batches:
        pct.update(b)
    assert pct.clip() < 0.5 * amax  # heavy tails: far below the absmax
    for kind, bits in (("int", 8), ("float", 8), ("int", 4)):
        ob = MSEObserver(kind, bits)
        for b in batches:
            ob.update(b)
        for b in batches:
            ob.refine(b)
        assert ob.clip() == pytest.approx(_brute_mse(allx, amax, kind, bits), rel=1e-12)
        if kind == "int":  # clipping the tail pays on a uniform grid
            assert ob.clip() < 0.9 * amax, (kind, bits)
        else:
            assert ob.clip() <= amax
    with pytest.raises(ConfigError, match="capacity"):
        small = PercentileObserver(99.0, capacity=10)
        small.update(allx[:1])
    with pytest.raises(ConfigError, match="percentile"):
        SequentialOptions(observer="percentile", percentile=0).check()
    with pytest.raises(ConfigError, match="observer 'p99' is not known"):
        SequentialOptions(observer="p99").check()


def test_engine_observers_percentile_and_mse(work):
    """Through calibrate_sequential: every dense Linear's static scale is the observer's
    value over exactly the (real) rows it was fed, / 448; smaller than min-max."""
    import numpy as np

    from k3convert.calibrate.observers import fake_quant

    root, data = work
    src = save_model("deepseek_v3", root / "dsv3-obs")
    calib = build_calibration_set(
        src, data, num_samples=SAMPLES, seq_len=SEQ, seed=0, packing=False, min_len=8
    )
    ckpt, plan = plan_quantization(src=src, scheme="fp8")
    got = {}
    for kind in ("minmax", "percentile", "mse"):
        seen: dict = {}

        def obs(i, name, x, m, seen=seen):
            seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1])[m.reshape(-1).bool()])

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = calibrate_sequential(
                ckpt, plan, calib, algorithm="static",
                options=SequentialOptions(batch_size=BATCH, observer=kind, percentile=99.0),
                journal=root / f"j-obs-{kind}", observer=obs,
            )  # fmt: skip
        got[kind] = (res, seen)
    res_mm, seen = got["minmax"]
    dense = [r for r in plan.quantized if r.role.layer is not None and r.role.expert is None]
    assert dense
    for r in dense:
        x = torch.cat(seen[r.name]).float()
        amax = float(x.abs().max())
        assert res_mm.input_scales[r.module] == pytest.approx(amax / 448, rel=1e-6)
        p99 = float(np.percentile(np.abs(x.numpy()).astype(np.float64), 99.0))
        s_pct = got["percentile"][0].input_scales[r.module]
        assert s_pct == pytest.approx(p99 / 448, rel=1e-6), r.name
        assert s_pct < res_mm.input_scales[r.module]
        s_mse = got["mse"][0].input_scales[r.module]
        assert s_mse == pytest.approx(_brute_mse(x, amax, "float", 8) / 448, rel=1e-6), r.name
        e_mse = float((fake_quant(x, s_mse * 448) - x).square().sum())
        e_mm = float((fake_quant(x, amax) - x).square().sum())
        assert e_mse <= e_mm and s_mse <= res_mm.input_scales[r.module]
    # the observers only change the input scales: the propagated inputs are the same
    for kind in ("percentile", "mse"):
        for n, xs in got[kind][1].items():
            for a, b in zip(xs, seen[n], strict=True):
                assert torch.equal(a, b), (kind, n)


def test_cli_observer_options(work, capsys):
    root, data = work
    src = root / "dsv3-obs"
    if not src.exists():
        save_model("deepseek_v3", src)
    out = root / "dsv3-mse"
    rc, text = _cli(["quantize", src, out, "--scheme", "fp8", "--calibrate", "--algorithm",
                     "static", "--dataset", data, "--num-samples", 4, "--seq-len", 16,
                     "--observer", "mse"])  # fmt: skip
    assert rc == 0, text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k3convert"]["calibration"]["options"]["observer"] == "mse"
    assert (out / "routing_counts.json").is_file()
    capsys.readouterr()
    rc = main([str(a) for a in ["quantize", src, root / "x", "--scheme", "fp8", "--calibrate",
               "--dataset", data, "--percentile", 99]])  # fmt: skip
    assert rc == 2 and "--percentile only applies" in capsys.readouterr().err
    assert not (root / "x").exists()


def test_kimi_k3_latent_moe_all_experts(tmp_path):
    """K3's latent MoE: the experts' input is routed_expert_down_proj's output; with the
    mode every expert's gate / up see all of it (equal scales), none falls back, and the
    propagated inputs and routing counts are the routed run's."""
    src, calib = k3_calibration(tmp_path)
    ckpt, plan = plan_quantization(src=src, scheme="fp8")
    runs = {}
    for mode in (False, True):
        seen: dict = {}

        def obs(i, name, x, m, seen=seen):
            if ".experts." not in name:
                seen.setdefault(name, []).append(x.clone())

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = calibrate_sequential(
                ckpt, plan, calib, algorithm="static",
                options=SequentialOptions(batch_size=1, moe_all_experts=mode),
                journal=tmp_path / f"j{mode}", observer=obs,
            )  # fmt: skip
        runs[mode] = (res, seen)
    off, on = runs[False][0], runs[True][0]
    assert off.routing_counts and on.routing_counts == off.routing_counts
    assert on.top_k == 2
    assert all(sum(c) == 2 * int(calib.attention_mask.sum()) for c in on.routing_counts.values())
    assert not on.fallbacks and on.expert_tokens == off.expert_tokens
    for L in on.routing_counts:
        gates = {
            n: s
            for n, s in on.input_scales.items()
            if f"layers.{L}." in n and ".experts." in n and n.endswith(".w1")
        }  # fmt: skip  (w1: gate)
        assert len(gates) > 1 and len(set(gates.values())) == 1, L
        assert len({off.input_scales[n] for n in gates}) > 1, L  # routed: each its own
    for n, xs in runs[False][1].items():
        for a, b in zip(xs, runs[True][1][n], strict=True):
            assert torch.equal(a, b), n
