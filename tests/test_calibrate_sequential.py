"""Layer-sequential calibration (k3convert.calibrate.sequential) and quantize --calibrate.

Oracles: transformers' own Llama (the Linear inputs it feeds layer 0, through forward
pre-hooks), the plain runtime on the unquantized checkpoint, and direct arithmetic
(Hessians as 2/n X^T X in float64, absmax / 448). Tiny models from tests/models.py.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from k3convert.calibrate.data import build_calibration_set
from k3convert.calibrate.gptq import HessianAccumulator, gptq_quantize
from k3convert.calibrate.sequential import (
    OverlaySource,
    SequentialOptions,
    calibrate_sequential,
)
from k3convert.checkpoint import open_checkpoint
from k3convert.cli import main
from k3convert.pipeline import quantize
from k3convert.pipeline.quantize import plan_quantization
from k3convert.runtime.runtime import Runtime
from tests.models import QUANT_FAMILIES, build_model, save_model

SAMPLES, SEQ, BATCH = 8, 24, 4


def _ids_file(path: Path, seed: int = 0) -> Path:
    """Pre-tokenized rows of varied length (the tiny models have no tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(24):
            n = int(torch.randint(10, 40, (1,), generator=g))
            f.write(json.dumps({"input_ids": torch.randint(3, 150, (n,), generator=g).tolist()}))
            f.write("\n")
    return path


def k3_calibration(tmp_path: Path):
    """(a tiny synthesized Kimi K3, two calibration rows of random ids, one right-padded)."""
    from k3convert.calibrate.data import CalibrationSet, fingerprint
    from k3convert.synth import synthesize

    src = tmp_path / "k3"
    synthesize(config="kimi-k3", out=src, tiny=True, encoding="plain", seed=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return src, CalibrationSet(ids, mask, "random ids", fingerprint(ids, mask, {}, None))


def _calib(model: Path, data: Path, seed: int = 0, packed: bool = False):
    if packed:  # as quantize(calibrate=SequentialOptions(...)) builds it by default
        return build_calibration_set(model, data, num_samples=SAMPLES, seq_len=SEQ, seed=seed)
    # one row per sample, right-padded: the padding mask is exercised
    return build_calibration_set(
        model, data, num_samples=SAMPLES, seq_len=SEQ, seed=seed, packing=False, min_len=8
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("calseq")
    llama = save_model("llama", root / "llama", **QUANT_FAMILIES["llama"])
    dsv3 = save_model("deepseek_v3", root / "dsv3")
    data = _ids_file(root / "ids.jsonl")
    return root, llama, dsv3, data


def _opts(**kw) -> SequentialOptions:
    return SequentialOptions(batch_size=BATCH, **kw)


def _run(model, data, scheme, algorithm, journal, observer=None, seed=0, packed=False, keep=(),
         **kw):  # fmt: skip
    ckpt, plan = plan_quantization(src=model, scheme=scheme, keep=keep)
    calib = _calib(model, data, seed, packed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = calibrate_sequential(ckpt, plan, calib, algorithm=algorithm,
                                   options=_opts(**kw), journal=journal,
                                   observer=observer)  # fmt: skip
    return ckpt, plan, calib, res


def _recorder(store: dict):
    def obs(layer, name, x, m):
        store.setdefault((layer, name), []).append((x.detach().clone(), m.clone()))

    return obs


def _hessian64(pairs) -> torch.Tensor:
    rows = torch.cat([x.reshape(-1, x.shape[-1])[m.reshape(-1)].double() for x, m in pairs])
    return 2.0 / rows.shape[0] * rows.t() @ rows


@pytest.fixture(scope="module")
def llama_gptq(work):
    root, llama, _, data = work
    seen: dict = {}
    ckpt, plan, calib, res = _run(llama, data, "w4a16", "gptq", root / "j-gptq", _recorder(seen))
    return ckpt, plan, calib, res, seen


def test_gptq_layer0_equals_direct(llama_gptq):
    ckpt, plan, calib, res, seen = llama_gptq
    layer0 = [r for r in plan.quantized if r.role.layer == 0]
    assert len(layer0) == 7 and all(r.name in res.part_rows for r in layer0)
    # transformers' Llama feeds layer 0's Linears the same inputs (padding excluded)
    model = build_model("llama", **QUANT_FAMILIES["llama"])
    tf_in: dict = {}
    hooks = []
    for r in layer0:

        def pre(mod, args, n=r.name):
            tf_in.setdefault(n, []).append(args[0].detach().clone())

        hooks.append(model.get_submodule(r.module).register_forward_pre_hook(pre))
    with torch.no_grad():
        for k in range(0, SAMPLES, BATCH):
            model(input_ids=calib.input_ids[k : k + BATCH],
                  attention_mask=calib.attention_mask[k : k + BATCH])  # fmt: skip
    for h in hooks:
        h.remove()
    for r in layer0:
        ours = seen[(0, r.name)]
        assert len(ours) == SAMPLES // BATCH
        h_engine = _hessian64(ours)
        h_tf = _hessian64([(x, m) for x, (_, m) in zip(tf_in[r.name], ours, strict=True)])
        torch.testing.assert_close(h_engine, h_tf, rtol=2e-4, atol=1e-5)
        # GPTQ with the Hessian of exactly those inputs: bit for bit the engine's parts
        acc = HessianAccumulator(r.shape[1], r.name)
        for x, m in ours:
            acc.add(x, m)
        torch.testing.assert_close(acc.hessian().double(), h_engine, rtol=1e-4, atol=1e-6)
        want = gptq_quantize(
            ckpt.get(r.name), acc.hessian(), r.scheme, name=r.name, act_order=True
        )  # the default
        got = res.weight_parts(r.name)
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), (r.name, k)
    tokens = int(calib.attention_mask.sum())
    assert tokens < SAMPLES * SEQ  # padding was present and excluded
    assert acc.tokens == tokens


def _layer_inputs(source, calib, layer: int, names) -> dict:
    """Inputs of ``names`` in ``layer`` when ``source`` runs layers 0..layer."""
    out: dict = {}
    with Runtime(source, prefetch=False, act_quant=False) as rt:
        rt.add_hook(lambda n, x, y: out.setdefault(n, []).append(x.clone()), set(names))
        for k in range(0, SAMPLES, BATCH):
            ids, m = calib.input_ids[k : k + BATCH], calib.attention_mask[k : k + BATCH]
            m = None if bool(m.all()) else m
            h = rt.embed(ids)
            for i in range(layer + 1):
                h = rt.run_layer(i, h, None, m)
    return out


def test_quantized_outputs_feed_the_next_layer(llama_gptq):
    ckpt, plan, calib, res, seen = llama_gptq
    layer0 = [r for r in plan.quantized if r.role.layer == 0]
    layer1 = [r.name for r in plan.quantized if r.role.layer == 1]
    # layer 0 with its GPTQ weights (dequantized) gives exactly the inputs layer 1 saw
    deq = {r.name: r.scheme.dequantize(res.weight_parts(r.name)) for r in layer0}
    quant_in = _layer_inputs(OverlaySource(ckpt, deq), calib, 1, layer1)
    plain_in = _layer_inputs(ckpt, calib, 1, layer1)
    for n in layer1:
        for (x, _), q in zip(seen[(1, n)], quant_in[n], strict=True):
            assert torch.equal(x, q), n
        masks = [m for _, m in seen[(1, n)]]
        h_q = _hessian64(seen[(1, n)])
        h_p = _hessian64(list(zip(plain_in[n], masks, strict=True)))
        rel = float((h_q - h_p).norm() / h_p.norm())
        assert 1e-4 < rel < 0.5, (n, rel)


def test_w4a16_gptq_layer_error_below_rtn(llama_gptq):
    ckpt, plan, calib, res, _ = llama_gptq
    layer0 = [r for r in plan.quantized if r.role.layer == 0]
    gptq = {r.name: r.scheme.dequantize(res.weight_parts(r.name)) for r in layer0}
    rtn = {r.name: r.scheme.dequantize(r.scheme.quantize(ckpt.get(r.name))) for r in layer0}

    def outputs(source):
        with Runtime(source, prefetch=False, act_quant=False) as rt:
            h = rt.embed(calib.input_ids)
            return rt.run_layer(0, h, None, calib.attention_mask)

    ref = outputs(ckpt)
    m = calib.attention_mask.bool()
    err = {k: float((outputs(OverlaySource(ckpt, w)) - ref)[m].pow(2).mean())
           for k, w in (("gptq", gptq), ("rtn", rtn))}  # fmt: skip
    print(f"layer-0 output MSE: gptq {err['gptq']:.3e}, rtn {err['rtn']:.3e}")
    assert err["gptq"] < 0.9 * err["rtn"], err


@pytest.mark.filterwarnings("ignore::k3convert.calibrate.sequential.ExpertFallbackWarning")
def test_static_fp8_scales_and_experts(work):
    root, _, dsv3, data = work
    seen: dict = {}

    def obs(layer, name, x, m):
        a = float(x[m.bool()].abs().amax()) if bool(m.any()) else 0.0
        seen[name] = max(seen.get(name, 0.0), a)

    ckpt, plan, calib, res = _run(dsv3, data, "fp8", "static", root / "j-static", obs)
    rows = [r for r in plan.quantized if r.role.layer is not None]
    assert rows and all(r.module in res.input_scales for r in rows)
    for r in rows:
        s = res.input_scales[r.module]
        assert torch.isfinite(torch.tensor(s)) and s > 0, r.name
        if seen.get(r.name, 0.0) > 0:
            assert s == pytest.approx(seen[r.name] / 448.0, rel=1e-6), r.name
        else:  # no token: listed, and its siblings' largest scale
            assert r.name in res.fallbacks
    # experts: token counts add up to top-k slots of the real tokens, per MoE layer
    k = ckpt.config["num_experts_per_tok"]
    tokens = int(calib.attention_mask.sum())
    for layer in (1, 2):
        gates = {n: c for n, c in res.expert_tokens.items()
                 if f"layers.{layer}." in n and n.endswith("gate_proj.weight")}  # fmt: skip
        assert len(gates) == 8 and sum(gates.values()) == k * tokens
        idle = {n for n, c in res.expert_tokens.items() if c == 0}
        assert idle == {n for n in res.fallbacks}
    # through the writer: every stored input_scale finite and non-zero
    out = root / "dsv3-fp8"
    qr = quantize(src=dsv3, out=out, scheme="fp8", calibrate=_opts(dataset=str(data),
                  num_samples=SAMPLES, seq_len=SEQ, packing=False), algorithm="static",
                  progress=False)  # fmt: skip
    assert not (root / "dsv3-fp8.calib").exists()
    q = open_checkpoint(out)
    scales = [q.get_parts(r.name)["input_scale"] for r in rows]
    assert all(bool(torch.isfinite(t).all()) and float(t) > 0 for t in scales)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k3convert"]["calibration"]["algorithm"] == "static"
    assert cfg["k3convert"]["calibration"]["dataset"]["source"] == str(data)
    assert set(qr.calibration.fallbacks) <= {r.name for r in rows if r.role.expert is not None}
    with Runtime(q, prefetch=False) as rt:  # static activation quantization runs
        logits = rt(calib.input_ids[:2], calib.attention_mask[:2])
    assert bool(torch.isfinite(logits).all())


class _Killed(RuntimeError):
    pass


def _kill_at(layer: int):
    def obs(i, name, x, m):
        if i == layer:
            raise _Killed(f"killed at layer {i}")

    return obs


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_kill_and_rerun_is_byte_identical(work, llama_gptq):
    root, llama, _, data = work
    fresh = llama_gptq[3]
    j = root / "j-kill"
    with pytest.raises(_Killed):
        _run(llama, data, "w4a16", "gptq", j, _kill_at(1))
    assert json.loads((j / "journal.json").read_text())["done"] == 1
    *_, res = _run(llama, data, "w4a16", "gptq", j)
    assert res.resumed_from == 1
    assert _files(j)["layer-0.safetensors"] == _files(fresh.journal)["layer-0.safetensors"]
    assert _files(j)["layer-1.safetensors"] == _files(fresh.journal)["layer-1.safetensors"]
    # the spilled hidden states (offload_dir) give the same bits
    (root / "offload").mkdir()
    (root / "offload" / "theirs.safetensors").write_bytes(b"not ours")
    *_, off = _run(llama, data, "w4a16", "gptq", root / "offload", offload_dir=root / "offload")
    assert _files(off.journal)["layer-1.safetensors"] == _files(j)["layer-1.safetensors"]
    off.cleanup()  # removes only the journal's own files
    assert sorted(_files(root / "offload")) == ["theirs.safetensors"]
    # through quantize: an interrupted journal in OUT.calib is resumed; same output bytes
    opts = _opts(dataset=str(data), num_samples=SAMPLES, seq_len=SEQ)
    a, b = root / "q-fresh", root / "q-resumed"
    quantize(src=llama, out=a, scheme="w4a16", calibrate=opts, algorithm="gptq", progress=False)
    with pytest.raises(_Killed):
        _run(llama, data, "w4a16", "gptq", root / "q-resumed.calib", _kill_at(1), packed=True)
    rb = quantize(src=llama, out=b, scheme="w4a16", calibrate=opts, algorithm="gptq",
                  progress=False)  # fmt: skip
    assert rb.calibration.resumed_from == 1
    assert _files(a) == _files(b)
    assert not (root / "q-resumed.calib").exists()


@pytest.mark.filterwarnings("ignore::k3convert.calibrate.sequential.ExpertFallbackWarning")
@pytest.mark.parametrize("model", ["llama", "dsv3"])
def test_gptq_fp_target_equals_plain_where_the_streams_coincide(work, model):
    """gptq_fp_target: where the quantized and the full-precision streams are the same
    (the first quantized layer: nothing quantized before it) the parts are plain GPTQ's,
    bit for bit (the FP inputs are captured from the right Linear, tokens and experts);
    the layer after differs (the option does something). dsv3: layer 0 kept, so layer 1
    (routed + shared experts) is the first quantized one."""
    root, llama, dsv3, data = work
    layer0 = ("re:model\\.layers\\.0\\..*",)
    src, scheme, keep, first = ((llama, "w4a16", (), 0) if model == "llama" else
                                (dsv3, "int8-channel", layer0, 1))  # fmt: skip
    *_, plain = _run(src, data, scheme, "gptq", root / f"j-plain-{model}", keep=keep)
    *_, fpt = _run(src, data, scheme, "gptq", root / f"j-fpt-{model}", keep=keep,
                   gptq_fp_target=0.5)  # fmt: skip
    a, b = _files(plain.journal), _files(fpt.journal)
    assert f"layer-{first - 1}.safetensors" not in a
    if model == "dsv3":
        assert any(".experts." in n for n in plain.part_rows if ".layers.1." in n)
    assert a[f"layer-{first}.safetensors"] == b[f"layer-{first}.safetensors"]
    assert a[f"layer-{first + 1}.safetensors"] != b[f"layer-{first + 1}.safetensors"]
    assert plain.part_rows == fpt.part_rows


def test_gptq_fp_target_kill_and_rerun_is_byte_identical(work):
    """The FP stream is journaled beside the quantized one: killed after layer 1 (of
    the MoE model, experts included), a rerun resumes and writes the same bytes, spilled
    (offload_dir) too; a journal of the other target is not resumed."""
    root, _, dsv3, data = work
    kw = dict(gptq_fp_target=0.5)
    *_, fresh = _run(dsv3, data, "int8-channel", "gptq", root / "j-fpt-fresh", **kw)
    j = root / "j-fpt-kill"
    with pytest.raises(_Killed):
        _run(dsv3, data, "int8-channel", "gptq", j, _kill_at(2), **kw)
    assert sorted(p.name for p in j.glob("fphidden-L*")) == [
        f"fphidden-L2-{b}.safetensors" for b in range(SAMPLES // BATCH)
    ]
    *_, res = _run(dsv3, data, "int8-channel", "gptq", j, **kw)
    assert res.resumed_from == 2
    want = _layer_files(fresh.journal)
    assert len(want) == 3 and _layer_files(j) == want
    assert not list(j.glob("*hidden-L*"))  # the last layer's inputs dropped, both streams
    with pytest.raises(_Killed):  # a plain GPTQ journal: not resumed with the option
        _run(dsv3, data, "int8-channel", "gptq", root / "j-fpt-q", _kill_at(2))
    *_, other = _run(dsv3, data, "int8-channel", "gptq", root / "j-fpt-q", **kw)
    assert other.resumed_from == 0 and _layer_files(other.journal) == want
    off = root / "offload-fpt"
    with pytest.raises(_Killed):
        _run(dsv3, data, "int8-channel", "gptq", off, _kill_at(2), offload_dir=off, **kw)
    assert len(list(off.glob("fphidden-L2-*.safetensors"))) == SAMPLES // BATCH
    *_, res = _run(dsv3, data, "int8-channel", "gptq", off, offload_dir=off, **kw)
    assert res.resumed_from == 2 and _layer_files(off) == want
    res.cleanup()
    assert not off.exists()


def _layer_files(d: Path) -> dict[str, bytes]:
    return {k: v for k, v in _files(d).items() if k.startswith("layer-")}


@pytest.mark.parametrize(
    "args, msg",
    [(["--gptq-fp-target", "1.5"], "--gptq-fp-target must be a number in [0, 1]"),
     (["--gptq-fp-target", "nan"], "--gptq-fp-target must be a number in [0, 1]"),
     (["--gptq-fp-target", "half"], "Invalid value for '--gptq-fp-target'"),
     (["--gptq-fp-target", "0.5", "--algorithm", "awq"],
      "--gptq-fp-target only applies with --algorithm gptq or smoothquant+gptq"),
     (["--gptq-fp-target", "0.5", "--calibrate-off"], None)],
)  # fmt: skip
def test_cli_gptq_fp_target_bad_values_exit_2(work, capsys, args, msg):
    root, llama, _, data = work
    out = root / "bad-fpt"
    cal = [] if "--calibrate-off" in args else ["--calibrate", "--dataset", str(data)]
    args = [a for a in args if a != "--calibrate-off"]
    rc = main(["quantize", str(llama), str(out), "--scheme", "w4a16", *cal, *args])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not out.exists()
    assert (msg or "--gptq-fp-target only apply with --calibrate") in err, err
    assert "Traceback" not in err


def test_awq_moe_kill_and_rerun_is_byte_identical(work):
    """AWQ on the MoE model: smoothed norms and the compensated router live in the journal
    beside the parts; a run killed after layer 1 resumes and writes the same bytes."""
    root, _, dsv3, data = work
    opts = _opts(dataset=str(data), num_samples=SAMPLES, seq_len=SEQ)
    a, b = root / "awq-fresh", root / "awq-resumed"
    ra = quantize(src=dsv3, out=a, scheme="int8-channel", calibrate=opts, algorithm="awq",
                  progress=False)  # fmt: skip
    assert ra.calibration.kept_rows, "smoothing changed no kept tensor"
    assert "model.layers.1.mlp.gate.weight" in ra.calibration.kept_rows  # the router
    with pytest.raises(_Killed):
        _run(dsv3, data, "int8-channel", "awq", root / "awq-resumed.calib", _kill_at(2),
             packed=True)  # fmt: skip
    rb = quantize(src=dsv3, out=b, scheme="int8-channel", calibrate=opts, algorithm="awq",
                  progress=False)  # fmt: skip
    assert rb.calibration.resumed_from == 2
    assert _files(a) == _files(b)


def test_changed_seed_starts_over(work):
    root, llama, _, data = work
    j = root / "j-seed"
    with pytest.raises(_Killed):
        _run(llama, data, "w4a16", "gptq", j, _kill_at(1))
    *_, res = _run(llama, data, "w4a16", "gptq", j, seed=1)
    assert res.resumed_from == 0 and len(res.layer_seconds) == 2
    shutil.rmtree(j)


def test_cli_missing_dataset_exit_2_nothing_written(work, capsys):
    root, llama, _, _ = work
    out = root / "cli-out"
    rc = main(["quantize", str(llama), str(out), "--scheme", "w4a16", "--calibrate",
               "--dataset", str(root / "missing.jsonl")])  # fmt: skip
    assert rc == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert not out.exists() and not (root / "cli-out.calib").exists()
    assert not list(root.glob(".cli-out*"))
    # calibration options without --calibrate are a usage error
    assert main(["quantize", str(llama), str(out), "--scheme", "w4a16", "--seed", "3"]) == 2
    assert not out.exists()


def test_cli_calibrate_gptq_prints_layers(work, capsys):
    root, llama, _, data = work
    out = root / "cli-gptq"
    rc = main(["quantize", str(llama), str(out), "--scheme", "w4a16", "--calibrate",
               "--dataset", str(data), "--num-samples", "4", "--seq-len", "16"])  # fmt: skip
    assert rc == 0
    cap = capsys.readouterr()
    assert "calibration (gptq): 2 layer(s)" in cap.out and "calibrated layer 1" in cap.err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k3convert"]["calibration"]["dataset"]["num_samples"] == 4
    # GPTQ's activation order is recorded as compressed-tensors' "static" (= weight):
    # no g_idx, the plain format, which compressed-tensors 0.20 parses and loads
    from compressed_tensors.quantization import QuantizationConfig

    qc = cfg["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["weights"]["actorder"] == "static"
    assert group["weights"]["observer"] == "minmax"
    from compressed_tensors.quantization.quant_args import ActivationOrdering

    parsed = QuantizationConfig.model_validate(qc)
    order = next(iter(parsed.config_groups.values())).weights.actorder
    assert ActivationOrdering.get_aliases()[order] == ActivationOrdering.WEIGHT
    assert not any(".weight_g_idx" in n for n in open_checkpoint(out).names())
    out2 = root / "cli-gptq-noorder"
    assert main(["quantize", str(llama), str(out2), "--scheme", "w4a16", "--calibrate",
                 "--dataset", str(data), "--num-samples", "4", "--seq-len", "16",
                 "--no-act-order", "--weight-observer", "mse"]) == 0  # fmt: skip
    (group,) = json.loads((out2 / "config.json").read_text())["quantization_config"][
        "config_groups"
    ].values()
    assert group["weights"]["actorder"] is None and group["weights"]["observer"] == "mse"


@pytest.mark.filterwarnings("ignore::k3convert.calibrate.sequential.ExpertFallbackWarning")
def test_kimi_k3_attention_residual_state_resumes_from_spill(tmp_path):
    """K3 (KDA + MLA layers, attention residuals, latent MoE): the AttnResState passes
    between layers, is spilled to offload_dir and resumed; same scales as in memory."""
    src, calib = k3_calibration(tmp_path)
    ckpt, plan = plan_quantization(src=src, scheme="fp8")

    def run(journal, observer=None, **kw):
        opts = SequentialOptions(batch_size=1, **kw)
        return calibrate_sequential(ckpt, plan, calib, algorithm="static", options=opts,
                                    journal=journal, observer=observer)  # fmt: skip

    mem = run(tmp_path / "mem")
    off = tmp_path / "off"
    with pytest.raises(_Killed):
        run(off, _kill_at(3), offload_dir=off)
    assert sorted(p.name for p in off.glob("hidden-*")) == ["hidden-L3-0.safetensors",
                                                            "hidden-L3-1.safetensors"]  # fmt: skip
    res = run(off, offload_dir=off)
    assert res.resumed_from == 3 and len(res.layer_seconds) == 5
    assert res.input_scales == mem.input_scales
    layers = {r.role.layer for r in plan.quantized if r.role.layer is not None}
    assert all(r.module in res.input_scales for r in plan.quantized if r.role.layer in layers)


@pytest.mark.filterwarnings("ignore::k3convert.calibrate.sequential.ExpertFallbackWarning")
def test_experts_see_the_tokens_transformers_routes_to_them(work):
    """Layer 0 kept (float), so layer 1's inputs are transformers' own: every routed
    expert's real-token count and Hessian match the rows DeepseekV3's router sends it."""
    _, _, dsv3, data = work
    ckpt, plan = plan_quantization(src=dsv3, scheme="fp8", keep=[r"re:model\.layers\.0\..*"])
    calib = _calib(dsv3, data)
    seen: dict = {}
    res = calibrate_sequential(ckpt, plan, calib, algorithm="static", options=_opts(),
                               journal=work[0] / "j-route", observer=_recorder(seen))  # fmt: skip
    model = build_model("deepseek_v3")
    got: list = []
    hook = model.model.layers[1].mlp.experts.register_forward_pre_hook(
        lambda mod, args: got.append((args[0].detach().clone(), args[1].clone()))
    )
    with torch.no_grad():
        for k in range(0, SAMPLES, BATCH):
            model(input_ids=calib.input_ids[k : k + BATCH],
                  attention_mask=calib.attention_mask[k : k + BATCH])  # fmt: skip
    hook.remove()
    valid = [
        calib.attention_mask[k : k + BATCH].reshape(-1).bool() for k in range(0, SAMPLES, BATCH)
    ]
    n_exp = ckpt.config["n_routed_experts"]
    idle = 0
    for e in range(n_exp):
        name = f"model.layers.1.mlp.experts.{e}.gate_proj.weight"
        rows = [x[(idx == e).any(-1) & v] for (x, idx), v in zip(got, valid, strict=True)]
        n = sum(r.shape[0] for r in rows)
        assert res.expert_tokens[name] == n, e
        if not n:
            idle += 1
            assert name in res.fallbacks
            continue
        ours = _hessian64(seen[(1, name)])
        ref = _hessian64([(r, torch.ones(r.shape[0], dtype=torch.bool)) for r in rows])
        torch.testing.assert_close(ours, ref, rtol=2e-4, atol=1e-5)
    assert idle < n_exp


def test_finished_journal_resumes_without_rerunning(work):
    """Every layer done (the write after calibration failed): a rerun takes the results
    from the journal instead of failing on hidden states it no longer needs."""
    root, llama, _, data = work
    j = root / "j-done"
    *_, first = _run(llama, data, "w4a16", "gptq", j)
    *_, again = _run(llama, data, "w4a16", "gptq", j)
    assert again.resumed_from == 2 and again.part_rows == first.part_rows
    for n in first.part_rows:
        a, b = first.weight_parts(n), again.weight_parts(n)
        assert all(torch.equal(a[k], b[k]) for k in a)
    shutil.rmtree(j)


def test_out_and_offload_dir_checked_before_calibrating(work, tmp_path, capsys):
    """An OUT quantize would refuse, or an --offload-dir that is a file or the source, is
    refused before any layer runs (exit 2, one line, nothing written)."""
    _, llama, _, data = work
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "mine.txt").write_text("keep me")
    base = ["quantize", str(llama), "--scheme", "w4a16", "--calibrate", "--dataset", str(data),
            "--num-samples", "4", "--seq-len", "16"]  # fmt: skip
    rc = main([base[0], base[1], str(not_a_model), *base[2:], "--force"])
    err = capsys.readouterr().err
    assert rc == 2 and "calibrated layer" not in err and "Traceback" not in err
    assert (not_a_model / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "notes.calib").exists()
    a_file = tmp_path / "spill"
    a_file.write_text("x")
    out = tmp_path / "o"
    rc = main([base[0], base[1], str(out), *base[2:], "--offload-dir", str(a_file)])
    err = capsys.readouterr().err
    assert rc == 2 and "not a directory" in err and "calibrated layer" not in err
    rc = main([base[0], base[1], str(out), *base[2:], "--offload-dir", str(llama)])
    assert rc == 2 and "calibrated layer" not in capsys.readouterr().err
    assert not out.exists()


def test_kimi_k25_images_reach_the_layers(tmp_path, capsys):
    """Image + text samples (pixels pre-processed into a .safetensors file, as verify's
    --pixel-values takes them): each sample is embedded with its images, so layer 0's
    Linears see what the runtime's own forward with those images feeds them (the runtime's
    K2.5 image path is checked against transformers in tests/test_runtime.py); a raw image
    file is refused with exit 2 and nothing written."""
    from safetensors.torch import save_file

    from k3convert.runtime import Runtime
    from tests.test_runtime import IMG, image_inputs, save_variant

    model = save_variant("kimi_k25", tmp_path / "k25")
    pv, grid = image_inputs([[1, 4, 6]])
    save_file({"pixel_values": pv, "image_grid_thw": grid}, str(tmp_path / "img.safetensors"))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 100, (20,), generator=g)
    ids[4:10] = IMG  # 1 x 4 x 6 patches merged 2 x 2: 6 image tokens
    rows = [{"input_ids": ids.tolist(), "images": ["img.safetensors"]},
            {"input_ids": torch.randint(3, 100, (12,), generator=g).tolist()}]  # fmt: skip
    data = tmp_path / "mm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calib = build_calibration_set(model, data, num_samples=2, seq_len=20, packing=False,
                                  min_len=4, shuffle=False)  # fmt: skip
    assert calib.images is not None
    ckpt, plan = plan_quantization(src=model, scheme="w8a8")
    name = next(r.name for r in plan.quantized if r.name.endswith("0.self_attn.q_a_proj.weight"))
    seen = {}

    def obs(layer, n, x, m):
        if layer == 0 and n == name:
            seen.setdefault("x", []).append(x.detach().clone().reshape(-1, x.shape[-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrate_sequential(ckpt, plan, calib, algorithm="gptq", options=_opts(),
                             journal=tmp_path / "j", observer=obs)  # fmt: skip
    ref = {}
    with Runtime(open_checkpoint(model), dtype="fp32", act_quant=False) as rt:

        def hook(n, x, y):  # (returns None: the output stays)
            ref.setdefault("x", x.reshape(-1, x.shape[-1]).clone())

        rt.add_hook(hook, {name})
        rt.forward(ids[None], pixel_values=pv, image_grid_thw=grid)
    first = seen["x"][0]
    assert first.shape == ref["x"].shape
    torch.testing.assert_close(first, ref["x"], rtol=1e-5, atol=1e-5)
    # a raw image file is refused: the model's image processor is remote code
    (tmp_path / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    data.write_text(json.dumps({"input_ids": ids.tolist(), "images": ["cat.png"]}) + "\n")
    capsys.readouterr()
    rc = main(["quantize", str(model), str(tmp_path / "out"), "--scheme", "w8a8",
               "--calibrate", "--dataset", str(data), "--num-samples", "1",
               "--seq-len", "20"])  # fmt: skip
    assert rc == 2 and "image processor" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme, same", [("int8-channel", True), ("int4-g32-asym", False)])
def test_awq_clip_step_only_on_group_schemes(work, scheme, same):
    """AWQ's clip step searches group-wise int Linears on their output error; a
    per-channel scheme keeps its own rounding (its Gram block would be the whole
    [in, in] matrix), so with or without the step its parts are the same bytes."""
    root, llama, _, data = work
    got = {}
    for clip in (True, False):
        _, plan, _, res = _run(llama, data, scheme, "awq", root / f"j-awq-{scheme}-{clip}",
                               awq_clip=clip)  # fmt: skip
        got[clip] = {r.name: res.weight_parts(r.name) for r in plan.quantized}
    diff = [n for n in got[True] if got[True][n] is not None and (got[False][n] is None or any(
        not torch.equal(got[True][n][k], got[False][n][k]) for k in got[True][n]))]  # fmt: skip
    assert (not diff) == same, diff
