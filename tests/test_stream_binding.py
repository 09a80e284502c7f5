"""A stream's files are its own (format version 4, issue 36): manifest.json is read only
inside the stream directory and within the format's size bound, every rank file is bound
to its manifest by a hash and the stream identity, and ``open_stream(ranks=...)`` takes
only a sequence of ints.

A rank directory copied in from another conversion of a model of the same shape must be
damage (exit 1, naming the rank) for ``shard --check``, ``open_stream`` (whole and per
rank), ``forward`` and ``verify``: before version 4 only verify's parity noticed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from k3convert.cli import main
from k3convert.shard import check, shard
from k3convert.stream import ManifestError, StreamError, open_stream, reader
from k3convert.stream.format import MAX_MANIFEST_BYTES, MAX_RANK_FILE_BYTES, StreamCorruptError

RANK0 = "rank00000/units.json"


@pytest.fixture(scope="module")
def streams(model_factory, tmp_path_factory):
    """Two conversions, same layout, of two llamas of the same shape (seeds 0 and 1)."""
    d = tmp_path_factory.mktemp("bound")
    out = {}
    for seed in (0, 1):
        src = model_factory("llama", seed=seed)
        out[seed] = shard(src=src, out=d / f"s{seed}", tp=2, pp=2, progress=False).out
    return out


@pytest.fixture
def copy(streams, tmp_path):
    dst = tmp_path / "s"
    shutil.copytree(streams[0], dst, symlinks=True)
    return dst


def test_a_rank_directory_from_another_conversion_is_damage(streams, copy, capsys):
    shutil.rmtree(copy / "rank00000")
    shutil.copytree(streams[1] / "rank00000", copy / "rank00000")
    want = "rank file of rank 0 does not belong to this stream"
    for opener in (lambda: open_stream(copy), lambda: open_stream(copy, ranks=[0])):
        with pytest.raises(ManifestError, match=want):
            opener()
    assert len(list(open_stream(copy, ranks=[1]).rank(1).units())) == 2  # rank 1 is intact
    rep = check(copy)
    assert rep.exit_code == 1 and any(want in p for p in rep.problems), rep.problems
    capsys.readouterr()
    assert main(["shard", "--check", str(copy)]) == 1
    assert main(["forward", str(copy), "--ids", "1 2"]) == 1
    assert main(["verify", str(copy), "--random", "1"]) == 1
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert text.count(want) == 3 and "Traceback" not in text, text


def test_the_same_rank_file_with_another_stream_identity_is_damage(streams, copy):
    """Even with its hash recorded anew (a manifest edited to match), a rank file that
    names another stream is refused: the identity is checked on its own."""
    other = json.loads((streams[1] / RANK0).read_text())["stream"]
    text = (copy / RANK0).read_text()
    mine = json.loads(text)["stream"]
    assert other != mine
    data = text.replace(mine, other).encode()
    (copy / RANK0).write_bytes(data)
    man = json.loads((copy / "manifest.json").read_text())
    man["ranks"][0]["units_hash"] = reader.unit_hashing.digest(mine, data)
    (copy / "manifest.json").write_text(json.dumps(man, indent=1))
    with pytest.raises(ManifestError, match=r"belongs to stream .* rank 0's directory comes"):
        open_stream(copy, ranks=[0])


def test_an_edited_stream_identity_is_damage(copy):
    man = json.loads((copy / "manifest.json").read_text())
    man["source"]["path"] = "/elsewhere"  # what was converted, edited by hand
    (copy / "manifest.json").write_text(json.dumps(man, indent=1))
    with pytest.raises(ManifestError, match="is not the identity of this manifest"):
        open_stream(copy)
    assert check(copy).exit_code == 1


# -- manifest.json: inside the directory, bounded ------------------------------------------
def test_a_manifest_linked_outside_the_stream_is_refused(copy, tmp_path, capsys, monkeypatch):
    outside = tmp_path / "outside.json"
    shutil.copyfile(copy / "manifest.json", outside)
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").symlink_to(outside)
    with pytest.raises(StreamCorruptError, match="outside the stream directory"):
        open_stream(copy)
    assert check(copy).exit_code == 1
    capsys.readouterr()
    assert main(["shard", "--check", str(copy)]) == 1
    assert "outside the stream directory" in capsys.readouterr().out
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").symlink_to("/etc/passwd")
    seen = []
    real = reader.read_bounded
    monkeypatch.setattr(
        reader, "read_bounded", lambda p, *a, **k: seen.append(p) or real(p, *a, **k)
    )
    with pytest.raises(StreamCorruptError, match="outside the stream directory"):
        open_stream(copy)
    assert seen == []  # refused before anything was opened


def test_a_manifest_linked_inside_the_stream_is_read(copy):
    (copy / "manifest.json").rename(copy / "real-manifest.json")
    (copy / "manifest.json").symlink_to("real-manifest.json")
    assert len(list(open_stream(copy).rank(0).units())) == 2


def test_a_manifest_over_the_bound_is_refused_before_it_is_read(copy, monkeypatch):
    """A manifest padded past the format's bound (a sparse file: nothing is written) is
    damage at once, from its size alone."""
    mp = copy / "manifest.json"
    with open(mp, "r+b") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    read = []
    monkeypatch.setattr(os, "read", lambda fd, n, _r=os.read: read.append(n) or _r(fd, n))
    with pytest.raises(ManifestError, match=f"above the format's bound of {MAX_MANIFEST_BYTES}"):
        open_stream(copy)
    assert read == []
    assert check(copy).exit_code == 1


def test_a_rank_file_over_the_bound_is_refused(copy):
    man = json.loads((copy / "manifest.json").read_text())
    man["ranks"][0]["units_bytes"] = MAX_RANK_FILE_BYTES + 1
    (copy / "manifest.json").write_text(json.dumps(man, indent=1))
    with pytest.raises(ManifestError, match=r"units_bytes: must be <= 536870912"):
        open_stream(copy)


def test_a_rank_file_over_a_lower_bound_is_refused_when_read(copy, monkeypatch):
    """The bound is checked on the opened file (fstat), whatever its recorded size."""
    monkeypatch.setattr(reader, "MAX_RANK_FILE_BYTES", 64)
    with pytest.raises(ManifestError, match="above the format's bound of 64 bytes"):
        open_stream(copy, ranks=[0])


def test_no_memory_for_a_manifest_is_a_clean_error(copy, monkeypatch):
    def oom(*a, **k):
        raise MemoryError

    monkeypatch.setattr(reader, "_manifest_json", oom)
    with pytest.raises(ManifestError, match="does not fit in the memory available"):
        open_stream(copy)


@pytest.mark.parametrize("which", ["manifest.json", RANK0])
def test_a_fifo_in_place_of_a_stream_file_does_not_block(copy, which):
    """A FIFO where manifest.json or a rank file should be is refused as not a regular
    file, never opened to wait for a writer (the rank file is opened non-blocking)."""
    (copy / which).unlink()
    os.mkfifo(copy / which)
    errors: list[BaseException] = []

    def open_it():
        try:
            open_stream(copy)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "open_stream blocked on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], StreamError), errors
    if which == RANK0:
        assert "rank file is not a regular file" in str(errors[0])


# -- open_stream(ranks=...) -----------------------------------------------------------------
@pytest.mark.parametrize("ranks", [[0.5], "01", b"01", [True], 0, {0}, [0, "1"]])
def test_open_stream_ranks_takes_a_sequence_of_ints(copy, ranks):
    with pytest.raises(TypeError, match="open_stream: ranks must be"):
        open_stream(copy, ranks=ranks)


def test_open_stream_ranks_in_range(copy):
    assert open_stream(copy, ranks=(1, 1, 0)).world == 4
    assert open_stream(copy, ranks=range(2)).world == 4
    with pytest.raises(StreamError, match="not all inside the world of 4"):
        open_stream(copy, ranks=[4])
