"""Format version 3: every rank's units in its own rank file (``rankNNNNN/units.json``).

Opening some ranks reads and validates only their rank files (the others when first
used); a damaged rank file is damage (exit 1) naming the file; version 2 streams (units
inline in manifest.json) are still read bit for bit; the writer commits the rank files
before manifest.json and a resumed run overwrites a stale one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from k3convert.cli import main
from k3convert.shard import check, shard
from k3convert.stream import (
    ManifestError,
    StreamCorruptError,
    open_stream,
    read_manifest_doc,
    reader,
    write_manifest_doc,
)
from k3convert.stream import hashing as unit_hashing
from k3convert.stream.format import dump_manifest, stream_identity
from tests.models import unit_hash
from tests.test_shard_support import tree_hashes
from tests.test_stream import _as_version

RANK0 = "rank00000/units.json"
RANK1 = "rank00001/units.json"


@pytest.fixture(scope="module")
def pristine(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("v3")
    return {
        c: shard(src=tiny_models["llama"], out=d / c, tp=2, pp=2, compress=c, progress=False).out
        for c in ("none", "zstd")
    }


@pytest.fixture
def copy(pristine, tmp_path):
    def make(compress="none") -> Path:
        dst = tmp_path / f"copy-{compress}"
        shutil.copytree(pristine[compress], dst, symlinks=True)
        return dst

    return make


def _tensors(out: Path, rank: int, **kw) -> dict[str, torch.Tensor]:
    st = open_stream(out, **kw)
    return {n: t for u in st.rank(rank).units() for n, t in u.tensors.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))
        for n in a
    )


def _rewrite_rank_file(out: Path, rel: str, doc) -> None:
    """Write a rank file and record its new size in manifest.json (so only the content
    is wrong, not the size)."""
    data = (
        doc
        if isinstance(doc, bytes)
        else (doc if isinstance(doc, str) else dump_manifest(doc)).encode()
    )
    (out / rel).write_bytes(data)
    man = json.loads((out / "manifest.json").read_text())
    i = int(rel[4:9])
    man["ranks"][i]["units_bytes"] = len(data)
    if "units_hash" in man["ranks"][i]:  # version 4: the hash the rank file is bound by
        man["ranks"][i]["units_hash"] = unit_hashing.digest(man["ranks"][i]["units_hash"], data)
    (out / "manifest.json").write_text(json.dumps(man, indent=1))


# -- layout on disk ---------------------------------------------------------------------
def test_manifest_names_each_rank_file(pristine):
    out = pristine["none"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["version"] == 4
    for i, r in enumerate(man["ranks"]):
        assert "units" not in r
        assert r["units_file"] == f"rank{i:05d}/units.json"
        assert r["units_bytes"] == (out / r["units_file"]).stat().st_size
        rdoc = json.loads((out / r["units_file"]).read_text())
        assert list(rdoc) == ["format", "version", "rank", "stream", "units"]
        assert (rdoc["format"], rdoc["version"], rdoc["rank"]) == ("musa-stream-rank", 4, i)
        assert rdoc["stream"] == man["stream_id"] == stream_identity(man, "xxh3-128")
        assert r["units_hash"] == unit_hash((out / r["units_file"]).read_bytes())
        assert [u["index"] for u in rdoc["units"]] == list(range(len(rdoc["units"])))
        # rendered as the manifest is: indent 1, a newline at the end
        assert (out / r["units_file"]).read_text() == json.dumps(rdoc, indent=1) + "\n"
    # nothing else beside the units in a rank directory
    for d in out.glob("rank*"):
        assert {p.name for p in d.iterdir() if not p.name.endswith(".safetensors")} == {
            "units.json"
        }


def test_read_and_write_manifest_doc_round_trip(copy):
    out = copy()
    before = tree_hashes(out)
    doc = read_manifest_doc(out)
    assert all("units" in r and "units_file" not in r for r in doc["ranks"])
    write_manifest_doc(out, doc)
    assert tree_hashes(out) == before  # byte for byte what the writer wrote


# -- version 2 is still read -------------------------------------------------------------
@pytest.mark.parametrize("comp", ["none", "zstd"])
def test_version_2_streams_are_still_read(pristine, tmp_path, comp):
    """A version 2 stream (units inline in manifest.json, "2" in the units' metadata)
    opens, per rank or whole, to bit-identical tensors and passes --check; damage in it
    is still caught, by its xxh3-128 hash."""
    out = tmp_path / "v2"
    shutil.copytree(pristine[comp], out)
    _as_version(out, 2)
    man = json.loads((out / "manifest.json").read_text())
    assert man["version"] == 2 and all("units" in r for r in man["ranks"])
    assert not list(out.glob("rank*/units.json"))
    assert check(out).exit_code == 0
    assert main(["shard", "--check", str(out)]) == 0
    for r in range(4):
        want = _tensors(pristine[comp], r)
        assert _same(want, _tensors(out, r))
        assert _same(want, _tensors(out, r, ranks=[r]))
    u = man["ranks"][1]["units"][0]
    assert u["hash"].startswith("xxh3-128:")
    data = bytearray((out / u["file"]).read_bytes())
    data[-1] ^= 1
    (out / u["file"]).write_bytes(data)
    rep = check(out)
    assert rep.exit_code == 1 and any("xxh3-128 hash mismatch" in p for p in rep.problems)


@pytest.mark.parametrize("comp", ["none", "zstd"])
def test_version_3_streams_are_still_read(pristine, tmp_path, comp):
    """A version 3 stream (rank files without a stream identity, no rank file hashes in
    manifest.json) opens to bit-identical tensors and passes --check; a rank file edited
    in it is still caught, by its recorded size."""
    out = tmp_path / "v3"
    shutil.copytree(pristine[comp], out)
    _as_version(out, 3)
    man = json.loads((out / "manifest.json").read_text())
    assert man["version"] == 3 and "stream_id" not in man
    assert all("units_hash" not in r for r in man["ranks"])
    assert "stream" not in json.loads((out / RANK1).read_text())
    assert check(out).exit_code == 0
    assert main(["shard", "--check", str(out)]) == 0
    for r in range(4):
        assert _same(_tensors(pristine[comp], r), _tensors(out, r, ranks=[r]))
    with open(out / RANK1, "a") as fh:
        fh.write(" ")
    assert check(out).exit_code == 1


def test_a_version_2_manifest_with_rank_files_is_refused(copy):
    out = copy()
    man = json.loads((out / "manifest.json").read_text())
    man["version"] = 2
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match=r"ranks\[0\].*units"):
        open_stream(out)


def test_a_version_3_manifest_with_inline_units_is_refused(copy):
    out = copy()
    man = read_manifest_doc(out)  # units inline, version 3
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match=r"ranks\[0\]: missing required key 'units_file'"):
        open_stream(out)
    assert check(out).exit_code == 1


def test_unit_metadata_must_carry_the_manifest_version(copy):
    out = copy()
    man = read_manifest_doc(out)
    u = man["ranks"][1]["units"][0]
    raw = (out / u["file"]).read_bytes()
    old = b'"format":"musa-stream","version":"4"'
    assert raw.count(old) == 1
    raw = raw.replace(old, b'"format":"musa-stream","version":"2"')
    (out / u["file"]).write_bytes(raw)
    u.update(hash=unit_hash(raw), raw_hash=unit_hash(raw))
    write_manifest_doc(out, man)
    with pytest.raises(StreamCorruptError, match=r"metadata .* disagrees"):
        list(open_stream(out).rank(1).units())


# -- per-rank open cost ------------------------------------------------------------------
def test_opening_one_rank_does_not_read_another_ranks_file(copy, monkeypatch):
    out = copy()
    _rewrite_rank_file(out, RANK0, "{ not json")
    read: list[str] = []
    real = reader.read_bounded

    def spy(path, *a, **k):
        read.append(path.name if path.name != "units.json" else str(path.relative_to(out)))
        return real(path, *a, **k)

    monkeypatch.setattr(reader, "read_bounded", spy)
    st = open_stream(out, ranks=[1])
    assert [p for p in read if p.endswith("units.json")] == [RANK1]
    monkeypatch.undo()
    assert len(list(st.rank(1).units())) == 2
    assert "units" not in st.manifest["ranks"][0]  # not loaded
    with pytest.raises(ManifestError, match=rf"{out / RANK0}: not valid JSON"):
        st.rank(0)
    with pytest.raises(ManifestError, match=rf"{out / RANK0}: not valid JSON"):
        open_stream(out)
    with pytest.raises(ManifestError, match=rf"{out / RANK0}: not valid JSON"):
        open_stream(out, ranks=[0])
    rep = check(out)
    assert rep.exit_code == 1 and str(out / RANK0) in rep.problems[0]


def test_a_missing_rank_file_is_damage(copy, capsys):
    out = copy()
    (out / RANK0).unlink()
    assert len(list(open_stream(out, ranks=[1]).rank(1).units())) == 2
    with pytest.raises(ManifestError, match=rf"{out / RANK0}: rank file is missing"):
        open_stream(out)
    rep = check(out)
    assert rep.status == "damaged" and rep.exit_code == 1, rep
    assert main(["shard", "--check", str(out)]) == 1
    assert main(["inspect", str(out)]) == 1
    err = capsys.readouterr().err
    assert "rank file is missing" in err and "Traceback" not in err


def _mutate(out: Path, case: str) -> None:
    rdoc = json.loads((out / RANK1).read_text())
    if case == "truncated":
        (out / RANK1).write_bytes((out / RANK1).read_bytes()[:-10])
    elif case == "longer":
        with open(out / RANK1, "a") as fh:
            fh.write(" ")
    elif case == "bad_json":
        _rewrite_rank_file(out, RANK1, (out / RANK1).read_text()[:-10])
    elif case == "not_utf8":
        _rewrite_rank_file(out, RANK1, b"\xff\xfe{}")
    elif case == "twice":
        text = (out / RANK1).read_text().replace('"rank": 1,', '"rank": 1,\n "rank": 1,', 1)
        _rewrite_rank_file(out, RANK1, text)
    elif case == "nan":
        _rewrite_rank_file(
            out, RANK1, (out / RANK1).read_text().replace('"rank": 1', '"rank": NaN')
        )
    elif case == "format":
        _rewrite_rank_file(out, RANK1, {**rdoc, "format": "musa-stream"})
    elif case == "version":
        _rewrite_rank_file(out, RANK1, {**rdoc, "version": 2})
    elif case == "rank":
        _rewrite_rank_file(out, RANK1, {**rdoc, "rank": 0})
    elif case == "list":
        _rewrite_rank_file(out, RANK1, [rdoc])
    elif case == "schema":
        del rdoc["units"][0]["tensors"][0]["split_dim"]
        _rewrite_rank_file(out, RANK1, rdoc)
    elif case == "unknown_key":
        _rewrite_rank_file(out, RANK1, {**rdoc, "extra": 1})
    elif case == "other_ranks_units":
        r0 = json.loads((out / RANK0).read_text())
        _rewrite_rank_file(out, RANK1, {**rdoc, "units": r0["units"]})
    elif case == "index":
        rdoc["units"][0]["index"] = 1
        _rewrite_rank_file(out, RANK1, rdoc)
    elif case == "unit_file":
        rdoc["units"][0]["file"] = "rank00001/../rank00000/0000-embed.safetensors"
        _rewrite_rank_file(out, RANK1, rdoc)
    elif case == "hash_form":
        rdoc["units"][0]["sha256"] = "0" * 64
        _rewrite_rank_file(out, RANK1, rdoc)
    elif case == "replaced":  # new content of the recorded size, the manifest untouched
        text = (out / RANK1).read_text()
        (out / RANK1).write_text(text.replace('"index": 0', '"index": 7', 1))
    elif case == "stream":
        _rewrite_rank_file(out, RANK1, {**rdoc, "stream": "xxh3-128:" + "0" * 32})
    elif case == "directory":
        (out / RANK1).unlink()
        (out / RANK1).mkdir()
    else:
        raise AssertionError(case)


DAMAGE = {
    "truncated": (
        ManifestError,
        "rank file is .* bytes but manifest.json says .*; it is truncated",
    ),
    "longer": (ManifestError, "rank file is .* bytes but manifest.json says .*; it is damaged"),
    "bad_json": (ManifestError, "not valid JSON"),
    "not_utf8": (ManifestError, "not valid JSON"),
    "twice": (ManifestError, "key 'rank' is listed twice"),
    "nan": (ManifestError, "holds NaN, which is not JSON"),
    "format": (ManifestError, "not a musa-stream-rank file"),
    "version": (ManifestError, "rank file version 2 differs from manifest.json's 4"),
    "replaced": (ManifestError, "rank file of rank 1 does not belong to this stream: its hash"),
    "stream": (ManifestError, "rank file belongs to stream 'xxh3-128:0+', not to this one"),
    "rank": (ManifestError, "rank file is for rank 0, not 1"),
    "list": (ManifestError, "not a musa-stream-rank file"),
    "schema": (ManifestError, r"violates the rank file schema: .*ranks\[1\]\.units\[0\]\.tensors"),
    "unknown_key": (ManifestError, "violates the rank file schema: .*unknown key 'extra'"),
    "other_ranks_units": (ManifestError, "is not the format's name for it"),
    "index": (ManifestError, r"ranks\[1\]\.units\[0\] has index 1"),
    "unit_file": (ManifestError, "violates the rank file schema|is not the format's name"),
    "hash_form": (ManifestError, "must record only hash and raw_hash"),
    "directory": (ManifestError, "rank file is not a regular file"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_rank_file_is_named(copy, capsys, case):
    """Each way a rank file can be damaged: the error names the file, the other ranks
    still open alone, and every verb reports damage (exit 1) in one line."""
    out = copy()
    _mutate(out, case)
    cls, msg = DAMAGE[case]
    where = str(out / RANK1)
    for opener in (lambda: open_stream(out), lambda: open_stream(out, ranks=[1])):
        with pytest.raises(cls, match=msg) as ei:
            opener()
        assert str(ei.value).startswith(where), str(ei.value)
    st = open_stream(out, ranks=[0])
    assert len(list(st.rank(0).units())) == 2
    with pytest.raises(cls, match=msg):
        st.rank(1)
    with pytest.raises(cls, match=msg):  # not marked loaded by the failed attempt
        st.rank(1)
    rep = check(out)
    assert rep.status == "damaged" and rep.exit_code == 1 and where in rep.problems[0], rep
    assert main(["shard", "--check", str(out)]) == 1
    assert main(["forward", str(out), "--ids", "1 2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and where in err


BAD_UNITS_FILES = [
    "../rank00001/units.json",
    "/etc/units.json",
    "rank00001/../rank00001/units.json",
    "rank00000/units.json",
    "rank00001/units.json.bak",
]


@pytest.mark.parametrize("units_file", BAD_UNITS_FILES)
def test_units_file_must_be_the_format_name(copy, units_file):
    out = copy()
    man = json.loads((out / "manifest.json").read_text())
    man["ranks"][1]["units_file"] = units_file
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match=r"ranks\[1\]"):
        open_stream(out, ranks=[0])  # refused from the manifest alone: before any open
    assert check(out).exit_code == 1


def test_a_rank_file_symlinked_outside_is_refused(copy, tmp_path):
    out = copy()
    outside = tmp_path / "elsewhere.json"
    shutil.copyfile(out / RANK1, outside)
    (out / RANK1).unlink()
    os.symlink(outside, out / RANK1)
    with pytest.raises(StreamCorruptError, match="outside the stream directory; refusing"):
        open_stream(out)
    assert len(list(open_stream(out, ranks=[0]).rank(0).units())) == 2
    assert check(out).exit_code == 1
    assert main(["shard", "--check", str(out)]) == 1


# -- checks across ranks run when every rank is loaded --------------------------------------
def test_one_hash_algorithm_across_rank_files(copy):
    """Rank 1 rewritten with (valid) sha256 unit hashes: alone it opens; with rank 0 -
    full open, check, or rank 0 first then rank 1 - the stream mixes two algorithms."""
    out = copy()
    man = read_manifest_doc(out)
    for u in man["ranks"][1]["units"]:
        raw = (out / u["file"]).read_bytes()
        u.update(hash=unit_hash(raw, "sha256"), raw_hash=unit_hash(raw, "sha256"))
    write_manifest_doc(out, man)
    assert len(list(open_stream(out, ranks=[1]).rank(1).units())) == 2
    for opener in (lambda: open_stream(out), lambda: open_stream(out, ranks=[0]).rank(1)):
        with pytest.raises(ManifestError, match="more than one hash algorithm"):
            opener()
    assert check(out).exit_code == 1


def test_coverage_across_ranks_is_checked_over_rank_files(copy):
    out = copy()
    man = read_manifest_doc(out)
    name = "model.layers.0.self_attn.q_proj.weight"
    (e1,) = [e for e in man["ranks"][1]["units"][1]["tensors"] if e["name"] == name]
    e1["offset"] = 0  # rank 1 claims rank 0's rows: the rows of rank 1 are nowhere
    write_manifest_doc(out, man)
    rep = check(out)
    assert rep.exit_code == 1 and any("cover 32 of 64" in p for p in rep.problems), rep.problems


# -- the writer ------------------------------------------------------------------------------
def test_a_stale_rank_file_of_an_interrupted_run_is_overwritten(tiny_models, pristine, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(pristine["none"], out)
    (out / "manifest.json").unlink()  # interrupted before the commit
    (out / ".k3-journal").mkdir()
    (out / RANK1).write_text('{"stale": true}')
    (out / "rank00000/units.json.tmp-1-2").write_text("half")
    with pytest.raises(Exception, match="incomplete conversion"):
        open_stream(out)
    r = shard(src=tiny_models["llama"], out=out, tp=2, pp=2, progress=False)
    assert r.units_written == 8  # no journal entries: every unit rewritten
    assert tree_hashes(out) == tree_hashes(pristine["none"])


def test_rank_files_are_committed_before_the_manifest(tiny_models, tmp_path, monkeypatch):
    """Interrupted after the rank files but before manifest.json: an incomplete stream,
    which a rerun completes to the same bytes."""
    import k3convert.stream.manifest_doc as manifest_doc

    present: list[str] = []
    real = manifest_doc.atomic_json

    def fail_on_manifest(path, doc, fsync=True):
        if path.name == "manifest.json":
            present.extend(
                sorted(
                    str(p.relative_to(path.parent)) for p in path.parent.glob("rank*/units.json")
                )
            )
            raise OSError(28, "No space left on device")
        return real(path, doc, fsync)

    monkeypatch.setattr(manifest_doc, "atomic_json", fail_on_manifest)
    with pytest.raises(Exception, match="No space left"):
        shard(src=tiny_models["llama"], out=tmp_path / "o", tp=2, progress=False)
    monkeypatch.undo()
    assert present == [RANK0, RANK1]
    assert not (tmp_path / "o/manifest.json").exists()
    with pytest.raises(Exception, match="incomplete conversion"):
        open_stream(tmp_path / "o")
    r = shard(src=tiny_models["llama"], out=tmp_path / "o", tp=2, progress=False)
    ref = shard(src=tiny_models["llama"], out=tmp_path / "ref", tp=2, progress=False)
    assert r.units_written == 0 and r.units_skipped == ref.units_written
    assert tree_hashes(tmp_path / "o") == tree_hashes(ref.out)
