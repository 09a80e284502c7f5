"""``convert`` with ``output.format: vllm`` in one pass: the rank files cut from the
planned (quantized as read) tensors, with no quantized checkpoint on disk, equal byte for
byte what ``quantize`` then ``shard --target vllm`` write; each tensor is quantized once;
an interrupted run resumes; ``verify OUT`` maps the files back from the tensor list OUT
carries."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from k3convert.checkpoint import open_checkpoint
from k3convert.engines import rank_files, vllm_write
from k3convert.engines.vllm_index import check_vllm
from k3convert.engines.vllm_sharded import DESCRIBED, INDEX
from k3convert.engines.vllm_source import VllmSource
from k3convert.engines.vllm_write import write_vllm
from k3convert.pipeline import quantize
from k3convert.pipeline.convert import convert
from k3convert.pipeline.planned import PlannedCheckpoint
from k3convert.pipeline.quantize import fuse_scales, prepare_quantization
from k3convert.recipe import load_recipe
from k3convert.stream.format import StreamCorruptError
from k3convert.synth import synthesize

#: (model, recipe body, tp, ep): dense int8 split over tp; DeepSeek-V3's released FP8
#: blocks GPTQ'd to int4 (MLA and experts, placed by EP: a loss report); Kimi K3's
#: released MXFP4 experts kept as stored under EP with its bf16 KDA / MLA
CASES = {
    "llama-w8a8": ("llama3-8b", "quantize: {scheme: w8a8}", 2, 1),
    # static FP8 with calibrated KV-cache scales (the index's extra tensors)
    "llama-fp8-kv": (
        "llama3-8b",
        "quantize: {scheme: fp8, calibrate: {algorithm: static, num_samples: 4, seq_len: 32, "
        "kv_cache: fp8}}",
        2,
        1,
    ),
    "dsv3-w4a16-gptq": (
        "deepseek-v3",
        "quantize: {scheme: w4a16, calibrate: {algorithm: gptq, num_samples: 4, seq_len: 32}}",
        2,
        2,
    ),
    "k3-keep": ("kimi-k3", "quantize: {rules: [{roles: [experts], scheme: keep}]}", 2, 2),
    # static FP8 input scales, FusedMoE's one per expert for gate and up
    "qwen3moe-fp8-static": (
        "qwen3-30b-a3b",
        "quantize: {scheme: fp8, calibrate: {algorithm: static, num_samples: 4, seq_len: 32}}",
        2,
        2,
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("op")
    made = {}
    for preset in ("llama3-8b", "deepseek-v3", "kimi-k3", "qwen3-30b-a3b"):
        # deepseek-v3 and kimi-k3 as released (FP8 blocks, MXFP4 experts)
        enc = {} if preset in ("deepseek-v3", "kimi-k3") else {"encoding": "plain"}
        synthesize(config=preset, out=root / preset, tiny=True, **enc)
        made[preset] = root / preset
    return made


def _recipe(tmp_path: Path, body: str, tp: int, ep: int) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(f"version: 1\n{body}\nlayout: {{tp: {tp}, moe_ep: {ep}}}\n"
                 "output: {format: vllm}\nverify: {enabled: false}\n")  # fmt: skip
    return p


def _rank_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("model-*.safetensors"))}


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_equals_quantize_then_shard(models, tmp_path, case):
    model, body, tp, ep = CASES[case]
    src, recipe = models[model], _recipe(tmp_path, body, tp, ep)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = convert(src=src, out=out, recipe=recipe, progress=False, log=lambda m: None)
        q = tmp_path / "q"
        quantize(src=src, out=q, recipe=load_recipe(recipe), progress=False)
    two = tmp_path / "two"
    write_vllm(src=q, out=two, tp=tp, ep=ep)
    assert not (tmp_path / "out.quantized").exists() and not (tmp_path / "out.calib").exists()
    one = _rank_files(out)
    assert len(one) == tp and one == _rank_files(two)
    # the config vLLM reads is the quantized checkpoint's
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (q / "config.json").read_text()
    )
    index = json.loads((out / INDEX).read_text())
    assert index["source"] == str(src.resolve()) and index["described"] == DESCRIBED
    assert "intact" in check_vllm(out) and res.report["rank_files"] == tp
    assert res.report["quantize"]["quantized"] > 0 and "quantize    " in res.summary()
    # the released FP8 blocks GPTQ re-encodes to int4 are measured, as quantize measures
    lossy = case.startswith("dsv3")
    assert (out / "transcode_report.json").is_file() == lossy
    if lossy:
        mine = json.loads((out / "transcode_report.json").read_text())
        theirs = json.loads((q / "transcode_report.json").read_text())
        assert mine["entries"] and len(mine["entries"]) == len(theirs["entries"])
        for a, b in zip(mine["entries"], theirs["entries"], strict=True):
            # counts exact; the float64 error sums may differ in the last bits with the
            # reduction's thread split
            errs = ("rel_err", "max_abs_err")
            assert {k: v for k, v in a.items() if k not in errs} == {
                k: v for k, v in b.items() if k not in errs}  # fmt: skip
            assert all(a[k] == pytest.approx(b[k], rel=1e-9) for k in errs), a["name"]
    # verify maps the files back with the carried tensor list: the quantized checkpoint's
    # every part, bit for bit, with that checkpoint gone
    import shutil

    ref = open_checkpoint(q)
    want = {n: ref.get_parts(n) for n in ref.names()}
    metas = {n: (ref.meta(n).encoding, ref.meta(n).shape) for n in ref.names()}
    shutil.rmtree(q)
    back = VllmSource(out)
    assert back.names() and set(back.names()) <= set(want)
    for n in back.names():
        enc, shape = metas[n]
        assert (back.meta(n).encoding, back.meta(n).shape) == (enc, shape), n
        if enc == "plain":  # (K3's A_log: vLLM holds the heads' prefix of the padding)
            got, t = back.get(n), want[n]["weight"]
            t = t[: got.shape[0]]
            assert got.dtype == t.dtype and torch.equal(got, t), n
            continue
        got = back.get_parts(n)
        for k, t in want[n].items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (n, k)


def test_each_tensor_is_quantized_once(models):
    """Two tp ranks each read a slice of every quantized tensor: the planned checkpoint
    produces each row once, holds it for its last reader and then drops it."""
    src = models["llama3-8b"]
    prep = prepare_quantization(src=open_checkpoint(src), scheme="w8a8", plan_only=True)
    fuse_scales(prep)
    data = PlannedCheckpoint(prep)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_vllm(src=data, out=Path(d) / "o", tp=2, origin=prep.ckpt)
    # (a kept row counts once too: its first read checks it, later reads map it)
    assert any(not data._cheap(r) for r in prep.plan.rows)
    assert data.produced == len(prep.plan.rows)
    assert data.held_bytes == 0


def test_an_interrupted_one_pass_resumes_under_the_same_quantization(models, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    src = models["llama3-8b"]
    recipe = _recipe(tmp_path, "quantize: {scheme: w8a8}", 2, 1)
    real = rank_files._write_rank

    def stop_at_rank_1(stage, journal, r, *a):
        if r.tp == 1:
            raise KeyboardInterrupt
        return real(stage, journal, r, *a)

    def run(out, rec=recipe, **kw):
        return convert(src=src, out=out, recipe=rec, progress=False, log=lambda m: None, **kw)

    out = tmp_path / "out"
    monkeypatch.setattr(rank_files, "_write_rank", stop_at_rank_1)
    with pytest.raises(KeyboardInterrupt):
        run(out)
    monkeypatch.setattr(rank_files, "_write_rank", real)
    assert not out.exists() and (tmp_path / ".out.vllm-partial").is_dir()
    res = run(out)
    assert res.report["rank_files_kept"] == 1
    fresh = tmp_path / "fresh"
    res = run(fresh, keep_intermediate=True)  # (also writes the quantized checkpoint)
    assert _rank_files(out) == _rank_files(fresh)
    assert res.report["quantized"] == str(tmp_path / "fresh.quantized")
    assert open_checkpoint(tmp_path / "fresh.quantized").meta(
        "model.layers.0.mlp.down_proj.weight").encoding == "int-quantized"  # fmt: skip
    # another quantization of the same source, with the same tensor table (GPTQ's int8
    # values, not round to nearest's): the interrupted run's rank file is not kept
    monkeypatch.setattr(rank_files, "_write_rank", stop_at_rank_1)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "o2")
    monkeypatch.setattr(rank_files, "_write_rank", real)
    (tmp_path / "x").mkdir()
    gptq = "quantize: {scheme: w8a8, calibrate: {algorithm: gptq, num_samples: 2, seq_len: 16}}"
    res = run(tmp_path / "o2", _recipe(tmp_path / "x", gptq, 2, 1))
    assert res.report["rank_files_kept"] == 0
    tables = [json.loads((d / INDEX).read_text())["files"] for d in (out, tmp_path / "o2")]
    assert [f["tensors"] for f in tables[0]] == [f["tensors"] for f in tables[1]]
    assert [f["hash"] for f in tables[0]] != [f["hash"] for f in tables[1]]


def test_verify_refuses_a_damaged_tensor_list(models, tmp_path):
    src = models["llama3-8b"]
    out = tmp_path / "out"
    convert(src=src, out=out, recipe=_recipe(tmp_path, "quantize: {scheme: w8a8}", 2, 1),
            progress=False, log=lambda m: None)  # fmt: skip
    p = out / DESCRIBED
    good = p.read_bytes()
    p.write_bytes(good[:-8])
    with pytest.raises(StreamCorruptError, match=DESCRIBED):
        check_vllm(out)  # its hash is bound by the index
    with pytest.raises(StreamCorruptError, match="unreadable"):
        VllmSource(out, check=False)
    # a list claiming more than the rank files hold is refused before anything is built
    import zstandard

    doc = json.loads(zstandard.ZstdDecompressor().decompress(good))
    doc["tensors"][0][2] = [1 << 20, 1 << 20]
    p.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))
    with pytest.raises(StreamCorruptError, match="more tensor bytes than"):
        VllmSource(out, check=False)
    p.write_bytes(good)  # and a config.json whose quantization_config is no object
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": "x"}))
    with pytest.raises(StreamCorruptError, match="not an object"):
        VllmSource(out, check=False)


def test_a_torchrun_peer_joins_only_the_stage_process_0_took(tmp_path):
    """A peer opens the stage at its path without following a link and checks process
    0's owner marker (not the inode: each node of a network file system has its own
    device numbers); another directory, or a link, there is refused."""
    from k3convert.checkpoint.output import OwnedStage
    from k3convert.errors import OutputError

    out = tmp_path / "out"
    with OwnedStage(out, vllm_write.STAGE, []) as lead:
        ident = lead.identity()
        assert ident["pid"] > 0
        peer = OwnedStage(out, vllm_write.STAGE, []).join(ident)
        (peer.work / "x").write_text("from the peer")
        assert (lead.work / "x").read_text() == "from the peer"
        peer.close()
        with pytest.raises(OutputError, match="not the directory"):
            OwnedStage(out, vllm_write.STAGE, []).join({**ident, "pid": ident["pid"] + 1})
        # the name swapped for a link to another directory
        lead.path.rename(tmp_path / "moved")
        (tmp_path / "elsewhere").mkdir()
        lead.path.symlink_to(tmp_path / "elsewhere")
        with pytest.raises(OutputError, match="cannot be opened"):
            OwnedStage(out, vllm_write.STAGE, []).join(ident)


def test_planned_parts_live_in_the_files_quantize_writes(models, tmp_path, monkeypatch):
    """Which member of a fused layer vLLM reads last goes by file order
    (``vllm_layers.last_loaded``): a planned part is placed in the file ``quantize`` would
    write it to, so the order is the written checkpoint's (here over several files)."""
    from k3convert.pipeline import planned

    monkeypatch.setattr(planned, "DEFAULT_SHARD_SIZE", 64 << 10)
    src = models["deepseek-v3"]
    prep = prepare_quantization(src=open_checkpoint(src), scheme="w4a16", plan_only=True)
    fuse_scales(prep)
    data = PlannedCheckpoint(prep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(src=src, out=tmp_path / "q", scheme="w4a16", progress=False,
                 shard_size=64 << 10)  # fmt: skip
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert len(set(wm.values())) > 2
    parts = [pm for n in data.names() for pm in data.meta(n).parts.values()]
    assert len(parts) == len(wm)
    for pm in parts:
        assert pm.file.name == wm[pm.name], pm.name
