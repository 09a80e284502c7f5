"""The MUSA stream format and its loader: weight source, read-ahead, corruption,
interrupted conversions, resume, format conformance and the golden byte layout."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import zstandard
from safetensors.torch import load_file, save_file

from k3convert.checkpoint import open_checkpoint
from k3convert.shard import check, shard
from k3convert.stream import (
    IncompleteStreamError,
    ManifestError,
    NotAStreamError,
    StreamCorruptError,
    StreamError,
    StreamVersionError,
    open_stream,
    read_manifest_doc,
    validate,
    validate_rank_file,
    write_manifest_doc,
)
from k3convert.stream.format import VERSION
from tests.models import unit_hash
from tests.test_shard_support import fp8_block, int4_group, reassemble, tree_hashes

ROOT = Path(__file__).parents[1]
SCHEMA = json.loads((ROOT / "formats/musa-stream.schema.json").read_text())
RANK_SCHEMA = {"$ref": "#/$defs/rank_file", "$defs": SCHEMA["$defs"]}  # second entry point


def make(src, out, **kw):
    kw.setdefault("progress", False)
    r = shard(src=src, out=out, **kw)
    man = json.loads(r.manifest.read_text())
    jsonschema.validate(man, SCHEMA)
    for rk in man["ranks"]:  # version 3: each rank file against the second entry point
        jsonschema.validate(json.loads((r.out / rk["units_file"]).read_text()), RANK_SCHEMA)
    return r.out


def _bits_equal(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# -- single-rank weight source ----------------------------------------------------------
@pytest.fixture(scope="module")
def quantized(model_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("qs")
    return {
        "fp8": fp8_block(model_factory("deepseek_v3"), d / "fp8"),
        "int4": int4_group(model_factory("llama"), d / "int4"),
    }


@pytest.mark.parametrize(
    "which,compress",
    [
        ("llama", "none"),
        ("qwen3", "zstd"),
        ("kimi_k25", "none"),
        ("fp8", "none"),
        ("int4", "zstd"),
    ],
)
def test_single_rank_stream_is_a_weight_source(tiny_models, quantized, tmp_path, which, compress):
    src = quantized.get(which) or tiny_models[which]
    out = make(src, tmp_path / "o", compress=compress)
    ck, st = open_checkpoint(src), open_stream(out)
    assert st.config == ck.config
    assert sorted(st.names()) == sorted(ck.names())
    for n in ck.names():
        cm, sm = ck.meta(n), st.meta(n)
        assert (sm.shape, sm.encoding, sorted(sm.parts)) == (
            cm.shape,
            cm.encoding,
            sorted(cm.parts),
        )
        assert sm.quant.num_bits == cm.quant.num_bits and sm.quant.block == cm.quant.block
        assert _bits_equal(st.get(n), ck.get(n)), n
        assert _bits_equal(st.get(n, torch.bfloat16), ck.get(n, torch.bfloat16)), n
        for p, t in ck.get_parts(n).items():
            assert _bits_equal(st.get_parts(n)[p], t)
    with pytest.raises(Exception, match="no tensor named"):
        st.get("nope.weight")


def test_multi_rank_stream_is_not_a_global_source(tiny_models, tmp_path):
    st = open_stream(make(tiny_models["llama"], tmp_path / "o", tp=2))
    with pytest.raises(StreamError, match=r"use stream\.rank"):
        st.names()
    r1 = st.rank(1)
    q = r1.get("model.layers.0.self_attn.q_proj.weight")
    full = open_checkpoint(tiny_models["llama"]).get("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, full[32:])  # rank 1 holds heads 2..3
    assert r1.meta("model.layers.0.self_attn.q_proj.weight").shape == (32, 64)


# -- units: order, read-ahead, zero copy -------------------------------------------------
@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_units_in_order_with_readahead(tiny_models, tmp_path, compress):
    out = make(tiny_models["kimi_k25"], tmp_path / "o", tp=2, pp=2, ep=2, compress=compress)
    st = open_stream(out)
    glob, _ = reassemble(out)
    for r in range(st.world):
        rk = st.rank(r)
        want = [u["name"] for u in st.manifest["ranks"][r]["units"]]
        for prefetch in (0, 3):
            units = list(rk.units(prefetch=prefetch))
            assert [u.name for u in units] == want
        for u in units:
            for e in u.entries:
                t = u[e["name"]]
                assert list(t.shape) == e["shape"]
                if e["split_dim"] is None and not e["tied_to"] and e["contents"] == "data":
                    assert _bits_equal(t, glob[e["name"]])
            if compress == "none":  # zero copy: tensors view the mapping of the whole file
                any_t = u[u.entries[0]["name"]]
                assert any_t.untyped_storage().nbytes() == u.file.stat().st_size


def test_units_are_aligned_valid_safetensors(tiny_models, tmp_path):
    out = make(tiny_models["deepseek_v3"], tmp_path / "o", tp=2, ep=2)
    man = read_manifest_doc(out)
    for rk in man["ranks"]:
        for u in rk["units"]:
            f = out / u["file"]
            raw = f.read_bytes()
            (n,) = struct.unpack("<Q", raw[:8])
            assert (8 + n) % 4096 == 0
            header = json.loads(raw[8 : 8 + n])
            assert header["__metadata__"]["unit"] == u["name"]
            for k, v in header.items():
                if k != "__metadata__" and not k.startswith("__pad__."):
                    assert v["data_offsets"][0] % 4096 == 0
            assert unit_hash(raw) == u["hash"] == u["raw_hash"]
            assert len(raw) == u["bytes"] == u["raw_bytes"]
            load_file(f)  # the reference reader accepts it


# -- corruption -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("pristine")
    return {c: make(tiny_models["llama"], d / c, tp=2, pp=2, compress=c) for c in ("none", "zstd")}


@pytest.fixture
def damaged(pristine, tmp_path):
    def copy(compress="none"):
        dst = tmp_path / f"copy-{compress}"
        shutil.copytree(pristine[compress], dst)
        man = read_manifest_doc(dst)
        return dst, man

    return copy


def _unit(man, rank, name):
    return next(u for u in man["ranks"][rank]["units"] if u["name"] == name)


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_flipped_byte_names_file_and_unit(damaged, compress):
    out, man = damaged(compress)
    u = _unit(man, 3, "layer.1")
    f = out / u["file"]
    data = bytearray(f.read_bytes())
    data[min(len(data) - 1, 4096 + 7)] ^= 0x10
    f.write_bytes(bytes(data))
    st = open_stream(out)
    with pytest.raises(StreamCorruptError) as ei:
        list(st.rank(3).units())
    msg = str(ei.value)
    assert str(f) in msg and "unit 'layer.1'" in msg and "rank 3" in msg and "hash" in msg
    list(st.rank(2).units())  # other ranks are fine
    rep = check(out)
    assert rep.status == "damaged" and rep.exit_code == 1 and len(rep.problems) == 1
    assert str(f) in rep.problems[0]
    if compress == "none":  # verification off: the damage goes unnoticed by design
        assert len(list(st.rank(3).units(verify_hashes=False))) == 2


def test_truncated_unit(damaged):
    out, man = damaged()
    u = _unit(man, 0, "embed")
    f = out / u["file"]
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(StreamCorruptError, match="truncated") as ei:
        open_stream(out)
    assert str(f) in str(ei.value) and "unit 'embed'" in str(ei.value)
    rep = check(out)
    assert rep.exit_code == 1 and "truncated" in rep.problems[0]


def test_missing_manifest_is_an_incomplete_conversion(damaged, tmp_path):
    out, _ = damaged()
    (out / "manifest.json").unlink()
    with pytest.raises(IncompleteStreamError, match="incomplete conversion"):
        open_stream(out)
    rep = check(out)
    assert rep.status == "not_stream" and rep.exit_code == 2
    assert "incomplete conversion" in rep.problems[0]
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAStreamError):
        open_stream(tmp_path / "empty")


@pytest.mark.parametrize("journal", [False, True])
def test_stream_without_manifest_in_every_verb(damaged, tmp_path, capsys, journal):
    """A stream whose manifest.json is gone (lost in a copy, or never written) is reported
    as an incomplete stream by every verb that takes a source, exit 2, one line; never as
    a checkpoint without weights."""
    from k3convert.cli import main

    out, _ = damaged()
    (out / "manifest.json").unlink()
    if journal:
        (out / ".k3-journal").mkdir()
    verbs = [
        ["verify", out],
        ["forward", out, "--ids", "1 2 3"],
        ["inspect", out],
        ["shard", out, tmp_path / "s", "--tp", "1"],
        ["quantize", out, tmp_path / "q", "--scheme", "w8a8"],
        ["plan", out],
    ]
    for argv in verbs:
        rc = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2, (argv[0], rc, err)
        assert "without its manifest.json" in err or "incomplete conversion" in err, (argv, err)
        assert "no weights found" not in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s").exists() and not (tmp_path / "q").exists()
    assert check(tmp_path / "empty").exit_code == 2


def test_unknown_version(damaged):
    out, man = damaged()
    man["version"] = 5
    write_manifest_doc(out, man)
    with pytest.raises(StreamVersionError, match="version 5 is not supported"):
        open_stream(out)
    assert check(out).exit_code == 2


def test_header_disagreeing_with_manifest(damaged):
    out, man = damaged()
    u = _unit(man, 0, "layer.0")
    e = next(e for e in u["tensors"] if e["dtype"] == "F32")
    e["dtype"] = "I32"  # same size, schema-valid, but not what the header says
    write_manifest_doc(out, man)
    st = open_stream(out)
    with pytest.raises(StreamCorruptError, match=f"header disagrees.*'{e['name']}'"):
        list(st.rank(0).units())
    assert check(out).exit_code == 1


def test_unit_swapped_for_another_is_caught_by_header(damaged):
    out, man = damaged()
    a, b = _unit(man, 0, "embed"), _unit(man, 1, "embed")
    shutil.copyfile(out / a["file"], out / b["file"])
    b.update(bytes=a["bytes"], hash=a["hash"], raw_bytes=a["raw_bytes"])
    b["raw_hash"] = a["raw_hash"]
    write_manifest_doc(out, man)
    with pytest.raises(StreamCorruptError, match=r"metadata .* disagrees"):
        list(open_stream(out).rank(1).units())


def test_schema_violation_names_key_path(damaged):
    out, man = damaged()
    del man["ranks"][1]["units"][0]["tensors"][0]["split_dim"]
    write_manifest_doc(out, man)
    with pytest.raises(ManifestError, match=r"ranks\[1\]\.units\[0\]\.tensors\[0\].*split_dim"):
        open_stream(out)
    rep = check(out)
    assert rep.exit_code == 1


def test_opening_some_ranks_checks_the_others_when_used(damaged):
    """open_stream(ranks=...) checks the header and those ranks' entries and files; a
    damaged other rank fails when it is asked for, and a full open / check still fail."""
    out, man = damaged()
    j, u = max(enumerate(man["ranks"][1]["units"]), key=lambda x: len(x[1]["tensors"]))
    assert len(u["tensors"]) > 1  # the last entry: not the one a rank left out still checks
    del u["tensors"][-1]["split_dim"]
    f = out / _unit(man, 3, "layer.1")["file"]
    f.write_bytes(f.read_bytes()[:-100])
    write_manifest_doc(out, man)
    st = open_stream(out, ranks=[0, 2])
    assert len(list(st.rank(0).units())) == 2 and len(list(st.rank(2).units())) == 2
    with pytest.raises(
        ManifestError, match=rf"ranks\[1\]\.units\[{j}\]\.tensors\[\d+\].*split_dim"
    ):
        st.rank(1)
    with pytest.raises(StreamCorruptError, match="truncated"):
        open_stream(out, ranks=[2]).rank(3)
    with pytest.raises(ManifestError, match="split_dim"):
        open_stream(out)
    with pytest.raises(ManifestError, match="split_dim"):
        open_stream(out, ranks=[1])
    with pytest.raises(StreamCorruptError, match="truncated"):
        open_stream(out, ranks=[3])
    assert check(out).exit_code == 1
    with pytest.raises(StreamError, match="world of 4"):
        open_stream(out, ranks=[4])


def test_a_logical_in_two_units_is_caught_for_the_rank_opened_late(damaged):
    out, man = damaged()
    units = man["ranks"][2]["units"]
    units[1]["tensors"][-1]["logical"] = units[0]["tensors"][-1]["logical"]
    write_manifest_doc(out, man)
    st = open_stream(out, ranks=[0])
    with pytest.raises(StreamCorruptError, match="rank 2: logical tensor"):
        st.rank(2)
    with pytest.raises(StreamCorruptError, match="rank 2: logical tensor"):
        open_stream(out)


def test_check_intact(pristine):
    for out in pristine.values():
        rep = check(out)
        assert rep.ok and rep.exit_code == 0 and rep.units_checked == 8, rep


# -- interruption and resume ------------------------------------------------------------
_KILL_SCRIPT = """
import sys, time
import k3convert.shard.unit_io as io
import k3convert.shard.writer as w
real_unit, real_bytes = w.write_unit, io.tensor_bytes
def slow_bytes(*a, **k):
    time.sleep(0.01)
    return real_bytes(*a, **k)
def unit(*a, **k):
    r = real_unit(*a, **k)
    print("unit", flush=True)
    return r
w.write_unit, io.tensor_bytes = unit, slow_bytes
w.shard(src=sys.argv[1], out=sys.argv[2], tp=2, pp=2, ep=2, progress=False, workers=1,
        compress=sys.argv[3])
print("finished", flush=True)
"""


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_killed_run_resumes_to_identical_output(tiny_models, tmp_path, compress):
    src = tiny_models["deepseek_v3"]
    ref = make(src, tmp_path / "ref", tp=2, pp=2, ep=2, compress=compress)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(src), str(out), compress],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    seen = 0
    for line in proc.stdout:
        seen += line.strip() == "unit"
        if seen == 4:
            time.sleep(0.05)  # somewhere inside the fifth unit
            proc.kill()
            break
    proc.wait()
    assert seen == 4, "the run finished before it could be killed"
    assert not (out / "manifest.json").exists()
    with pytest.raises(IncompleteStreamError):
        open_stream(out)
    r = shard(src=src, out=out, tp=2, pp=2, ep=2, compress=compress, progress=False)
    assert r.units_skipped >= 3 and r.units_written + r.units_skipped == 10
    assert tree_hashes(out) == tree_hashes(ref)
    assert check(out).ok


def test_resume_after_a_same_size_same_mtime_source_swap_rewrites_every_unit(
    tiny_models, tmp_path, monkeypatch
):
    """Resume is keyed on the source's content: a weight file swapped for another of the
    same size, its mtime restored, between an interrupted run and its rerun, makes the
    rerun rewrite every unit (no stream mixing two checkpoints); unchanged, it resumes."""
    import os

    import k3convert.shard.writer as w

    src = tmp_path / "src"
    shutil.copytree(tiny_models["llama"], src)
    real, n = w.write_unit, []

    def stop_after_two(*a, **k):
        if len(n) == 2:
            raise KeyboardInterrupt
        n.append(1)
        return real(*a, **k)

    def interrupted(out):
        n.clear()
        monkeypatch.setattr(w, "write_unit", stop_after_two)
        with pytest.raises(KeyboardInterrupt):
            shard(src=src, out=out, tp=2, progress=False, workers=1)
        monkeypatch.setattr(w, "write_unit", real)

    interrupted(tmp_path / "same")
    assert shard(src=src, out=tmp_path / "same", tp=2, progress=False).units_skipped == 2
    interrupted(tmp_path / "out")
    f = next(src.glob("*.safetensors"))
    st = f.stat()
    t = load_file(f)
    save_file({k: v.flip(0).contiguous() for k, v in t.items()}, f, metadata={"format": "pt"})
    assert f.stat().st_size == st.st_size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = shard(src=src, out=tmp_path / "out", tp=2, progress=False)
    assert r.units_skipped == 0
    ref = make(src, tmp_path / "ref", tp=2)
    assert tree_hashes(tmp_path / "out") == tree_hashes(ref)


# -- format conformance -----------------------------------------------------------------
def test_packaged_schema_is_the_published_one():
    pkg = ROOT / "k3convert/stream/manifest.schema.json"
    assert pkg.read_bytes() == (ROOT / "formats/musa-stream.schema.json").read_bytes()
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_builtin_validator_agrees_with_jsonschema(pristine):
    man = json.loads((pristine["none"] / "manifest.json").read_text())  # version 3: split
    rank0 = json.loads((pristine["none"] / "rank00000/units.json").read_text())
    inline = read_manifest_doc(pristine["none"])
    inline["version"] = 2  # the same document as a version 2 manifest: units inline
    assert validate(man) == [] and validate(inline) == [] and validate_rank_file(rank0, 0) == []
    jsonschema.validate(man, SCHEMA)
    jsonschema.validate(inline, SCHEMA)
    jsonschema.validate(rank0, RANK_SCHEMA)
    bad = [
        lambda m: m.update(version="1"),
        lambda m: m["layout"].update(tp=0),
        lambda m: m["layout"].update(experts={"policy": "x"}),
        lambda m: m["source"].pop("files"),
        lambda m: m["ranks"][0].pop("units_bytes"),
        lambda m: m["ranks"][0].update(units_file="../rank00000/units.json"),
        lambda m: m["ranks"][0].update(units_file="/abs/rank00000/units.json"),
        lambda m: m["ranks"][0].update(units_bytes="12"),
        lambda m: m["ranks"][0].update(units=rank0["units"]),  # version 3: no inline units
        lambda m: m["ranks"][0].update(extra=1),
        lambda m: m.update(version=2),  # a version 2 rank holds its units inline
    ]
    bad_inline = [  # versions 1 and 2: units inline, no rank files
        lambda m: m["ranks"][0]["units"][0].update(hash="xyz"),
        lambda m: m["ranks"][0].update(units_file="rank00000/units.json", units_bytes=9),
        lambda m: m["ranks"][0].pop("units"),
    ]
    bad_rank = [
        lambda m: m["units"][0].update(hash="xyz"),
        lambda m: m["units"][0].update(hash="sha256:" + "0" * 32),
        lambda m: m["units"][0].update(sha256="0" * 64, raw_sha256="0" * 64),
        lambda m: m["units"][0].update(compression="lz4"),
        lambda m: m["units"][0]["tensors"][0].update(extra=1),
        lambda m: m["units"][0].update(name="layer"),
        lambda m: m.update(format="musa-stream"),
        lambda m: m.update(version=2),
        lambda m: m.update(rank=-1),
        lambda m: m.update(units=[]),
        lambda m: m.update(extra=1),
        lambda m: m.pop("rank"),
    ]
    for doc, schema, check_it, muts in (
        (man, SCHEMA, validate, bad),
        (inline, SCHEMA, validate, bad_inline),
        (rank0, RANK_SCHEMA, lambda m: validate_rank_file(m, 0), bad_rank),
    ):
        for mutate in muts:
            m = json.loads(json.dumps(doc))
            mutate(m)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(m, schema)
            assert check_it(m), mutate


def _as_version(out: Path, version: int) -> None:
    """Rewrite a version 4 stream as version 1, 2 or 3 would have written it (spec 3.2,
    4), by hand: the version in every unit's metadata (same length, so no offset moves);
    versions 1 and 2 with every rank's units inline in manifest.json (no rank files) and
    the unit hashes computed with hashlib / xxhash (bare sha256 fields for version 1, the
    stream's algorithm as ``ALGO:HEX`` for version 2); version 3 with rank files that
    carry no stream identity and a manifest that records no rank file hash."""
    man = read_manifest_doc(out)
    man["version"] = version
    for r in man["ranks"]:
        for u in r["units"]:
            p = out / u["file"]
            raw = p.read_bytes()
            if u["compression"] == "zstd":
                raw = zstandard.ZstdDecompressor().decompress(raw)
            old = b'"format":"musa-stream","version":"%d"' % VERSION
            assert raw.count(old) == 1
            raw = raw.replace(old, b'"format":"musa-stream","version":"%d"' % version)
            stored = raw
            if u["compression"] == "zstd":
                stored = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
            p.write_bytes(stored)
            algo = u.pop("hash").split(":")[0]
            del u["raw_hash"]
            u.update(bytes=len(stored), raw_bytes=len(raw))
            if version == 1:
                u.update(sha256=hashlib.sha256(stored).hexdigest())
                u.update(raw_sha256=hashlib.sha256(raw).hexdigest())
            else:
                u.update(hash=unit_hash(stored, algo), raw_hash=unit_hash(raw, algo))
        if version < 3:
            (out / f"rank{r['rank']:05d}/units.json").unlink()
    if version == 3:
        write_manifest_doc(out, man)
        text = (out / "manifest.json").read_text()
        assert '"units_hash"' not in text and '"stream_id"' not in text
        return
    text = json.dumps(man, indent=1)
    assert '"units_file"' not in text
    (out / "manifest.json").write_text(text)


@pytest.mark.parametrize("comp", ["none", "zstd"])
def test_version_1_streams_are_still_read(pristine, tmp_path, comp):
    """A version 1 stream (sha256 unit hashes) loads to the same tensors, passes --check,
    and a damaged unit in it is still caught, by its sha256."""
    out = tmp_path / "v1"
    shutil.copytree(pristine[comp], out)
    _as_version(out, 1)
    assert check(out).exit_code == 0
    want = {n: t for u in open_stream(pristine[comp]).rank(0).units() for n, t in u.tensors.items()}
    got = {n: t for u in open_stream(out).rank(0).units() for n, t in u.tensors.items()}
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    man = read_manifest_doc(out)
    u = man["ranks"][0]["units"][0]
    data = bytearray((out / u["file"]).read_bytes())
    data[-1] ^= 1
    (out / u["file"]).write_bytes(data)
    rep = check(out)
    assert rep.exit_code == 1 and any("sha256" in p for p in rep.problems), rep.problems


def test_a_unit_with_both_hash_forms_is_refused(damaged):
    out, man = damaged()
    man["ranks"][0]["units"][0]["sha256"] = "0" * 64  # beside hash / raw_hash
    write_manifest_doc(out, man)
    with pytest.raises(ManifestError, match="must record only hash and raw_hash, found hash, "):
        open_stream(out)


def test_a_float_version_is_refused(damaged):
    out, man = damaged()
    man["version"] = 3.0  # equal to 3 in JSON Schema, but not a version this reader knows
    write_manifest_doc(out, man)
    with pytest.raises(StreamVersionError, match=r"version 3\.0 is not supported"):
        open_stream(out)


GOLDEN_CONFIG = {
    "model_type": "llama",
    "vocab_size": 4,
    "hidden_size": 2,
    "intermediate_size": 2,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
}
# version 4 (the unit metadata says "4"; version 3 was ac4ac66f...81593f, version 2
# deaeae6f...eda355, the same bytes with "3" / "2"), and the rank file: units.json as the
# writer renders it, less its "stream" line (the stream identity covers the source's
# absolute path, which is tmp_path here; checked against the manifest's instead)
GOLDEN_HEAD_SHA256 = "c350f188b2c99c82328bcb3ee7089405e4973280372368b07d5fd265d7ac28ec"
GOLDEN_RANK_FILE_SHA256 = "f5ab5fc96924cb828fcb60e4ed11bd3f8c1e909bd43093d4c4a78e0f8b521d50"


def test_golden_unit_byte_layout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(GOLDEN_CONFIG))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    names += [f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
    names += [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    shapes = {"model.embed_tokens.weight": (4, 2), "lm_head.weight": (4, 2)}
    sd = {}
    for i, n in enumerate(names):
        shape = shapes.get(n, (2,) if "norm" in n else (2, 2))
        sd[n] = (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 10 * i).reshape(
            shape
        )
    save_file(sd, src / "model.safetensors")
    out = make(src, tmp_path / "out")
    unit = (out / "rank00000/0002-head.safetensors").read_bytes()
    header = (
        b'{"__metadata__":{"format":"musa-stream","version":"4","rank":"0","unit":"head"},'
        b'"lm_head.weight":{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]},'
        b'"__pad__.1":{"dtype":"U8","shape":[4064],"data_offsets":[32,4096]},'
        b'"model.norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[4096,4104]}}'
    )
    want = struct.pack("<Q", 4088) + header + b" " * (4088 - len(header))
    want += sd["lm_head.weight"].numpy().tobytes() + bytes(4064)
    want += sd["model.norm.weight"].numpy().tobytes()
    assert len(unit) == 8200
    assert unit == want
    assert hashlib.sha256(unit).hexdigest() == GOLDEN_HEAD_SHA256
    man = json.loads((out / "manifest.json").read_text())
    rank_file = (out / "rank00000/units.json").read_bytes()
    assert man["version"] == 4 and list(man)[:3] == ["format", "version", "stream_id"]
    assert man["ranks"] == [
        {"rank": 0, "pp_rank": 0, "tp_rank": 0, "ep_rank": 0, "moe_tp_rank": 0,
         "units_file": "rank00000/units.json", "units_bytes": len(rank_file),
         "units_hash": unit_hash(rank_file)}
    ]  # fmt: skip
    sid = f' "stream": "{man["stream_id"]}",\n'.encode()
    assert rank_file.count(sid) == 1
    rank_file = rank_file.replace(sid, b"")
    assert rank_file.startswith(
        b'{\n "format": "musa-stream-rank",\n "version": 4,\n "rank": 0,\n "units": [\n  {\n'
        b'   "index": 0,\n   "name": "embed",\n   "layer": null,\n'
        b'   "file": "rank00000/0000-embed.safetensors",\n   "compression": "none",\n'
    )
    assert hashlib.sha256(rank_file).hexdigest() == GOLDEN_RANK_FILE_SHA256
