"""``convert``: one streaming pass equals quantize + shard byte for byte; resumable.

The reference for "the same output" is what the two separate, already-tested stages
write: ``quantize`` to a compressed-tensors checkpoint, then ``shard`` of that checkpoint.
convert never writes that checkpoint, so equal units prove its on-demand quantization
(the planned checkpoint) produces exactly quantize's tensors, split exactly as shard
splits them. Interruptions are real exceptions raised from inside the unit writer.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import k3convert.shard.writer as shard_writer
from k3convert.errors import OutputError
from k3convert.pipeline import quantize
from k3convert.pipeline.convert import PlannedCheckpoint, convert
from k3convert.recipe import parse_recipe
from k3convert.shard import shard
from k3convert.stream import read_manifest_doc
from k3convert.synth import synthesize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE = {
    "description": "int4 experts, fp8 attention",
    "quantize": {
        "rules": [
            {"roles": ["experts"], "scheme": "w4a16", "options": {"group_size": 32}},
            {"roles": ["attention"], "scheme": "fp8-dynamic"},
            {"roles": ["shared_experts", "dense_mlp"], "scheme": "int8-g32"},
        ]
    },
    "layout": {"tp": 2, "pp": 2, "moe_ep": 2},
    "output": {"compression": "zstd"},
    "verify": {"samples": 2, "seq_len": 16, "decode": 2},
}


@pytest.fixture(scope="module")
def k25(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("k25") / "m"
    synthesize(config="kimi-k25", out=d, tiny=True, seed=1)
    return d


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory) -> Path:
    """Pre-tokenized calibration rows (the tiny synth models have no tokenizer)."""
    p = tmp_path_factory.mktemp("ids") / "ids.jsonl"
    rng = random.Random(0)
    p.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(1, 250) for _ in range(48)]}) + "\n"
            for _ in range(8)
        )
    )
    return p


def _files(d: Path, skip=("report.json",)) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def _no_identity(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files with each rank file's ``stream`` line removed: the stream identity covers
    the source recorded in the manifest, which is the original for convert and the
    intermediate quantized checkpoint for quantize + shard (checked apart)."""
    return {
        k: re.sub(rb'\n "stream": "[^"]*",', b"", v) if k.endswith("/units.json") else v
        for k, v in files.items()
    }


def _two_step(src: Path, tmp: Path, recipe: dict) -> Path:
    q, s = tmp / "q", tmp / "s"
    quantize(src=src, out=q, recipe=parse_recipe(recipe), progress=False)
    lay = recipe["layout"]
    shard(src=q, out=s, tp=lay["tp"], pp=lay.get("pp", 1), ep=lay.get("moe_ep", 1),
          compress=recipe["output"]["compression"], progress=False)  # fmt: skip
    return s


def test_convert_equals_quantize_then_shard(k25, tmp_path):
    out = tmp_path / "c"
    res = convert(src=k25, out=out, recipe=parse_recipe(RECIPE), progress=False)
    assert res.passed is True
    ref = _two_step(k25, tmp_path, RECIPE)
    got, want = _no_identity(_files(out)), _no_identity(_files(ref))
    # every unit and the carried config.json byte for byte; the manifest's rank tables
    units = [k for k in want if k.startswith("rank") and not k.endswith("/units.json")]
    assert len(units) == 12 and all(got[k] == want[k] for k in units)
    rank_files = [k for k in want if k.endswith("/units.json")]  # the rank tables, too
    assert len(rank_files) == 4 and all(got[k] == want[k] for k in rank_files)
    assert got["config.json"] == want["config.json"]
    mg, mw = read_manifest_doc(out), read_manifest_doc(ref)
    assert mg["ranks"] == mw["ranks"] and mg["layout"] == mw["layout"]
    sid = json.loads((out / "manifest.json").read_text())["stream_id"]
    assert json.loads((out / "rank00000/units.json").read_text())["stream"] == sid
    # the manifest records the original source (not an intermediate) and the recipe
    assert mg["source"]["path"] == str(k25.resolve())
    assert mg["source"]["recipe"]["layout"]["tp"] == 2
    assert not (tmp_path / "c.quantized").exists() and not (tmp_path / "c.calib").exists()
    rep = json.loads((out / "report.json").read_text())
    assert rep["passed"] is True and rep["units"]["written"] == 12
    assert rep["sizes"]["source_bytes"] > rep["sizes"]["quantized_bytes"] > 0
    assert set(rep["seconds"]) >= {"plan", "write", "verify", "total"}
    assert rep["verify"]["logits"]["kld"]["mean"] < 0.05


def test_cache_eviction_recomputes_the_same_bytes(k25, tmp_path):
    """With no cache budget a TP-split tensor is quantized again for every reader: more
    work, the same bytes."""
    recipe = parse_recipe({**RECIPE, "verify": {"enabled": False}})
    a = convert(src=k25, out=tmp_path / "a", recipe=recipe, progress=False)
    seen = {}
    orig = PlannedCheckpoint.__init__

    def spy(self, prepared, cache_bytes=0):
        orig(self, prepared, 0)
        seen["ck"] = self

    mp = pytest.MonkeyPatch()
    mp.setattr(PlannedCheckpoint, "__init__", spy)
    try:
        convert(src=k25, out=tmp_path / "b", recipe=recipe, progress=False)
    finally:
        mp.undo()
    assert a.passed is None
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    ck = seen["ck"]
    rows = len([r for r in ck.prepared.plan.rows if not r.kept and not r.as_stored])
    assert ck.produced > rows  # recomputed for later readers
    assert ck.held_bytes == 0  # nothing left behind


class _Stop(Exception):
    pass


def _interrupt_after(monkeypatch, n: int) -> list:
    """Make the unit writer raise after ``n`` units (the way a kill stops a run: the
    units written so far are on disk with their journal entries, nothing else)."""
    done: list = []
    started = [0]
    lock = threading.Lock()
    real = shard_writer.write_unit

    def write_unit(*a, **kw):
        with lock:  # units are written on several threads
            if started[0] >= n:
                raise _Stop(f"interrupted after {n} units")
            started[0] += 1
        rec = real(*a, **kw)
        done.append(a[1].file)
        return rec

    monkeypatch.setattr(shard_writer, "write_unit", write_unit)
    return done


def test_interrupted_convert_resumes_to_identical_output(k25, tmp_path, monkeypatch):
    recipe = parse_recipe(RECIPE)
    full = tmp_path / "full"
    convert(src=k25, out=full, recipe=recipe, progress=False)
    out = tmp_path / "out"
    done = _interrupt_after(monkeypatch, 5)
    with pytest.raises(_Stop):
        convert(src=k25, out=out, recipe=recipe, progress=False)
    assert len(done) == 5 and not (out / "manifest.json").exists()
    monkeypatch.undo()
    res = convert(src=k25, out=out, recipe=recipe, progress=False)
    assert res.units_skipped == 5 and res.units_written == 7
    assert _files(out) == _files(full)
    # a complete OUT of the same recipe is verified again, not rewritten
    again = convert(src=k25, out=out, recipe=recipe, progress=False)
    assert again.units_written == 0 and again.passed is True
    assert _files(out) == _files(full)


def test_calibrated_convert_resumes_without_recalibrating(k25, ids_file, tmp_path, monkeypatch):
    lay = {"tp": 2, "moe_ep": 2, "redundant_experts": 2, "expert_load": "calibration"}
    doc = {**_calibrated(ids_file, **lay), "verify": RECIPE["verify"]}
    recipe = parse_recipe(doc)
    full = tmp_path / "full"
    first = convert(src=k25, out=full, recipe=recipe, progress=False)
    assert first.passed is True
    cal = first.report["quantize"]["calibration"]
    assert cal["algorithm"] == "gptq"
    assert first.report["quantize"]["calibration_layers_resumed"] == 0
    man = read_manifest_doc(full)
    assert any(f["name"] == "routing_counts.json" for f in man["files"])
    out = tmp_path / "out"
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        convert(src=k25, out=out, recipe=recipe, progress=False)
    assert (tmp_path / "out.calib").is_dir()  # the journal survives the interruption
    monkeypatch.undo()
    res = convert(src=k25, out=out, recipe=recipe, progress=False)
    layers = json.loads((k25 / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert res.report["quantize"]["calibration_layers_resumed"] == layers
    assert res.units_skipped == 3
    assert _files(out) == _files(full)
    assert not (tmp_path / "out.calib").exists()  # removed once the stream is complete


def test_keep_intermediate_writes_quantize_output(k25, tmp_path):
    recipe = parse_recipe({**RECIPE, "verify": {"enabled": False}})
    convert(src=k25, out=tmp_path / "c", recipe=recipe, keep_intermediate=True,
            progress=False, report_html=tmp_path / "r.html")  # fmt: skip
    q = tmp_path / "q"
    quantize(src=k25, out=q, recipe=recipe, progress=False)
    inter = tmp_path / "c.quantized"
    assert _files(inter) == _files(q)
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!doctype html>") and "stream size" in html
    assert "<= -" not in html  # a limit verify did not set is left out


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "k3convert", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=600,
    )  # fmt: skip


def test_cli_convert_exit_codes(k25, tmp_path):
    import yaml

    rp = tmp_path / "r.yaml"
    rp.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "c"
    # verify below its threshold: exit 1, the stream is still written and reported
    r = _cli("convert", k25, out, "-r", rp, "--no-progress", "--set", "verify.max_kld=0",
             "--set", "verify.min_top1=1.0")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "verify      FAIL" in r.stdout and (out / "manifest.json").is_file()
    assert json.loads((out / "report.json").read_text())["passed"] is False
    # another stream format over a complete OUT: refused before any work
    r = _cli("convert", k25, out, "-r", rp, "--no-progress", "--set", "output.compression=none")
    assert r.returncode == 2 and "this recipe did not write" in r.stderr
    assert "Traceback" not in r.stderr
    # other verify thresholds over the same stream: verified again, nothing rewritten
    before = _files(out)
    html = tmp_path / "r.html"
    r = _cli("convert", k25, out, "-r", rp, "--no-progress", "--set", "verify.decode=0",
             "--report-html", html)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "0 written, 12 already done" in r.stdout and "verify      PASS" in r.stdout
    assert f"html        {html}" in r.stdout and html.is_file()  # every written path said
    assert html.read_text().count("verify: ") == 1  # the verdict once (a banner)
    assert _files(out) == before
    # the same rerun over a stream whose rank file was damaged: exit 1, the file named
    rank1 = out / "rank00001" / "units.json"
    rank1.write_bytes(rank1.read_bytes()[:100])
    r = _cli("convert", k25, out, "-r", rp, "--no-progress", "--set", "verify.decode=0")
    assert r.returncode == 1 and "rank00001/units.json" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # a bad override: exit 2, key path, nothing created
    r = _cli("convert", k25, tmp_path / "d", "-r", rp, "--set", "layout.tq=2")
    assert r.returncode == 2 and "layout.tq" in r.stderr and "did you mean 'tp'" in r.stderr
    assert not (tmp_path / "d").exists()
    # OUT inside the source is refused
    r = _cli("convert", k25, k25 / "x", "-r", rp)
    assert r.returncode == 2 and not (k25 / "x").exists()


def _calibrated(ids_file: Path, **layout) -> dict:
    return {
        **RECIPE,
        "quantize": {
            **RECIPE["quantize"],
            "calibrate": {
                "algorithm": "gptq",
                "dataset": str(ids_file),
                "num_samples": 8,
                "seq_len": 32,
                "batch_size": 4,
            },
        },
        "layout": layout or RECIPE["layout"],
        "verify": {"enabled": False},
    }


def test_keep_intermediate_after_calibration_equals_quantize(k25, ids_file, tmp_path):
    """The intermediate checkpoint is written from the calibration journal before the
    journal is removed; it equals quantize's own calibrated output."""
    recipe = parse_recipe(_calibrated(ids_file))
    convert(src=k25, out=tmp_path / "c", recipe=recipe, keep_intermediate=True, progress=False)
    q = tmp_path / "q"
    quantize(src=k25, out=q, recipe=recipe, progress=False)
    assert _files(tmp_path / "c.quantized") == _files(q)
    assert not (tmp_path / "c.calib").exists()
    # a complete OUT cannot make the intermediate again without redoing the work
    with pytest.raises(OutputError, match="keep-intermediate"):
        convert(src=k25, out=tmp_path / "c", recipe=recipe, keep_intermediate=True,
                progress=False)  # fmt: skip


def test_quantize_output_as_source_carries_each_file_once(k25, ids_file, tmp_path):
    """A calibrated quantize output carries routing_counts.json; converting it with a
    calibrating recipe writes this run's counts, listed once, and the stream checks."""
    from k3convert.stream import check

    recipe = parse_recipe(_calibrated(ids_file, tp=2, moe_ep=2))
    q = tmp_path / "q"
    quantize(src=k25, out=q, recipe=recipe, progress=False)
    assert (q / "routing_counts.json").is_file()
    rtn = {"algorithm": "rtn", "dataset": str(ids_file), "num_samples": 8, "seq_len": 32}
    again = parse_recipe(
        {
            **_calibrated(ids_file, tp=2, moe_ep=2),
            "quantize": {"scheme": "fp8-dynamic", "calibrate": rtn},
        }
    )
    out = tmp_path / "s"
    convert(src=q, out=out, recipe=again, progress=False)
    names = [f["name"] for f in read_manifest_doc(out)["files"]]
    assert sorted(names) == sorted(set(names)) and "routing_counts.json" in names
    assert check(out).ok


def test_changed_source_is_not_taken_for_converted(k25, tmp_path):
    """A complete OUT is recognised by the source files' names, sizes and mtimes: the
    same bytes count rewritten in place (a new revision) is not verified as if done."""
    import os
    import shutil

    src = tmp_path / "src"
    shutil.copytree(k25, src)
    recipe = parse_recipe({**RECIPE, "verify": {"enabled": False}})
    out = tmp_path / "c"
    convert(src=src, out=out, recipe=recipe, progress=False)
    st = next(src.glob("*.safetensors"))
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))
    with pytest.raises(OutputError, match="did not write from this source"):
        convert(src=src, out=out, recipe=recipe, progress=False)


def test_bad_html_path_fails_before_any_work(k25, tmp_path):
    recipe = parse_recipe(RECIPE)
    with pytest.raises(OutputError, match="HTML report"):
        convert(src=k25, out=tmp_path / "c", recipe=recipe, progress=False,
                report_html=tmp_path / "no" / "such" / "r.html")  # fmt: skip
    assert not (tmp_path / "c").exists()


def test_smoothed_kept_norms_reach_every_rank(k25, ids_file, tmp_path):
    """SmoothQuant changes kept tensors (the norms); a norm replicated on both TP ranks
    must be the smoothed one on each, as quantize + shard writes it (regression: a
    second reader once got the source's norm)."""
    doc = {
        "quantize": {
            "scheme": "w8a8",
            "calibrate": {
                "algorithm": "smoothquant",
                "dataset": str(ids_file),
                "num_samples": 8,
                "seq_len": 32,
            },
        },
        "layout": {"tp": 2},
        "output": {"compression": "none"},
        "verify": {"enabled": False},
    }
    recipe = parse_recipe(doc)
    out = tmp_path / "c"
    convert(src=k25, out=out, recipe=recipe, progress=False)
    ref = _two_step(k25, tmp_path, doc)
    want, got = _no_identity(_files(ref)), _no_identity(_files(out))
    units = [k for k in want if k.startswith("rank")]
    assert units and all(got[k] == want[k] for k in units)


def test_a_calibration_shortfall_is_said_even_without_progress(k25, ids_file, tmp_path, capsys):
    """Fewer calibration samples than the recipe asks for (the data ran out) is a warning
    on the terminal, with or without the progress bar (not only in config.json)."""
    doc = _calibrated(ids_file)
    doc["quantize"]["calibrate"] = {**doc["quantize"]["calibrate"], "num_samples": 64}
    convert(src=k25, out=tmp_path / "c", recipe=parse_recipe(doc), progress=False)
    err = capsys.readouterr().err
    assert "warning: calibration: 12 of the 64 requested samples" in err, err


def test_html_report_shows_expert_placement_per_ep_rank(tmp_path):
    """The page lists, per EP rank, the experts it holds and the share of routed tokens
    it serves (a copied expert's tokens split over its copies): the shares add to 100%."""
    import re

    from k3convert.layout import place_experts
    from k3convert.report_html import write_html

    load = [40, 1, 1, 1, 30, 1, 1, 25]  # two hot experts get the two redundant copies
    held = place_experts(8, 2, load=load, redundant=2, where="layer 1")
    ranks_of = [[r for r, h in enumerate(held) if e in h] for e in range(8)]
    experts = {"policy": "load", "num_experts": 8, "redundant": 2,
               "layers": {"1": {"ep_rank_experts": held, "expert_ep_ranks": ranks_of,
                                "load": load}}}  # fmt: skip
    rep = {"recipe": "r", "source": "/m", "out": "/o", "model_type": "qwen3_moe",
           "layout": {"tp": 2, "pp": 1, "moe_tp": 1, "moe_ep": 2, "redundant_experts": 2,
                      "world": 2}, "processes": 1,
           "sizes": {"source_bytes": 1, "stream_bytes": 1, "units": 1}, "seconds": {}}  # fmt: skip
    page = write_html(rep, None, tmp_path / "r.html", experts=experts).read_text()
    assert "<h2>Expert placement</h2>" in page and "8 routed experts per layer over 2 EP" in page
    rows = re.findall(r"<tr><td>(\d)</td><td>([^<]*)</td><td>(\d+)</td><td>([\d.]+)%", page)
    assert [int(r[0]) for r in rows] == [0, 1]
    assert [int(r[2]) for r in rows] == [len(h) for h in held] and sum(len(h) for h in held) == 10
    want = [sum(load[e] / len(ranks_of[e]) for e in h) / sum(load) for h in held]
    assert [float(r[3]) for r in rows] == [round(100 * w, 1) for w in want]
    assert abs(sum(float(r[3]) for r in rows) - 100) < 0.2


K3_KEEP = {
    "description": "released MXFP4 experts and bf16 weights, copied as stored",
    "quantize": {"rules": [{"roles": ["experts"], "scheme": "keep"}]},
    "layout": {"tp": 2, "moe_ep": 2},
    "output": {"compression": "none"},
    "verify": {"samples": 1, "seq_len": 8, "decode": 0},
}


def _poke(src: Path, name: str, fill) -> None:
    """Overwrite the stored bytes of tensor ``name`` in ``src``'s safetensors file:
    ``fill(view)`` edits a writable copy, written back in place."""
    import struct

    import torch

    from k3convert.checkpoint.safetensors_io import ST_DTYPES

    for f in sorted(src.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        head = json.loads(raw[8 : 8 + n])
        if name in head:
            e = head[name]
            a, b = (8 + n + o for o in e["data_offsets"])
            t = torch.frombuffer(raw[a:b], dtype=torch.uint8).clone()
            t = t.view(ST_DTYPES[e["dtype"]][0])
            fill(t)
            raw[a:b] = t.view(torch.uint8).numpy().tobytes()
            f.write_bytes(bytes(raw))
            return
    raise AssertionError(f"{name} not in {src}")


def test_convert_copies_stored_rows_checked(tmp_path):
    """Rows the output holds as stored (released MXFP4 experts under ``keep``, bf16
    weights) are copied from the source's mapping, equal to quantize + shard byte for
    byte; each is checked first as quantize checks it: an E8M0 scale of 255 and a NaN in
    a kept weight are refused, naming the tensor, and no complete stream is left."""
    from k3convert.checkpoint import open_checkpoint
    from k3convert.errors import K3Error

    src = tmp_path / "k3"
    synthesize(config="kimi-k3", out=src, tiny=True, seed=2, overrides={"layers": 2})
    ck = open_checkpoint(src)
    parts = [p.name for n in ck.names() for p in ck.meta(n).parts.values()]
    scale = next(n for n in parts if ".experts." in n and n.endswith("weight_scale"))
    norm = next(n for n in parts if n.endswith("norm.weight"))
    out = tmp_path / "c"
    assert convert(src=src, out=out, recipe=parse_recipe(K3_KEEP), progress=False).passed
    ref = _two_step(src, tmp_path, K3_KEEP)
    got, want = _no_identity(_files(out)), _no_identity(_files(ref))
    units = [k for k in want if k.startswith("rank")]
    assert units and all(got[k] == want[k] for k in units)
    for name, fill in ((scale, lambda t: t.view(-1)[3].fill_(255)),
                       (norm, lambda t: t.view(-1)[1].fill_(float("nan")))):  # fmt: skip
        bad = tmp_path / f"bad-{len(name)}"
        synthesize(config="kimi-k3", out=bad, tiny=True, seed=2, overrides={"layers": 2})
        _poke(bad, name, fill)
        dst = tmp_path / f"o-{len(name)}"
        with pytest.raises(K3Error, match=re.escape(name.rsplit(".", 1)[0])):
            convert(src=bad, out=dst, recipe=parse_recipe(K3_KEEP), progress=False)
        assert not (dst / "manifest.json").exists()
