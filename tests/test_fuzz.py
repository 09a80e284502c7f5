"""Deterministic mutation fuzzing of the checkpoint and stream readers (bench/fuzz.py).

Each run mutates small valid inputs (byte flips, truncations, header length / offset /
dtype / shape edits, duplicate / swapped / renamed entries, index and manifest JSON
edits, links out of the directory) with a fixed seed; every outcome must be a clean
K3Error or an accepted read whose bytes equal the file's. A failure prints each crash
site with the mutation and the command that replays it. Longer runs:
``python bench/fuzz.py --seconds 120 --target both``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"


def _load():
    if "k3fuzz" not in sys.modules:  # bench/ is not a package: load the script once
        spec = importlib.util.spec_from_file_location("k3fuzz", _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["k3fuzz"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["k3fuzz"]


fuzz = _load()

SEED = 12
CHECKPOINT_ITERATIONS = 2500  # ~10 s
STREAM_ITERATIONS = 600  # ~12 s, plus ~5 s to build the four template streams


def _assert_clean(tally, rejections: set[str]) -> None:
    report = tally.report(verbose=True)
    assert tally.n_crashes == 0, "reader crashes or wrong accepted reads:\n" + report
    assert tally.total == tally.accepted + sum(tally.rejected.values())
    # the harness itself must reach both outcomes, or it tests nothing
    assert tally.accepted >= tally.total // 50, report
    assert rejections <= set(tally.rejected), report


def test_fuzz_checkpoint_reader(tmp_path):
    tally = fuzz.run("checkpoint", seed=SEED, iterations=CHECKPOINT_ITERATIONS, work=tmp_path)
    _assert_clean(tally, {"SafetensorsFormatError", "CheckpointError"})
    assert set(tally.ops) == {"plain", "int4-sym", "int4-asym", "fp8", "sharded"}


def test_fuzz_stream_reader(tmp_path):
    tally = fuzz.run("stream", seed=SEED, iterations=STREAM_ITERATIONS, work=tmp_path)
    _assert_clean(tally, {"StreamCorruptError", "ManifestError"})
    assert set(tally.ops) == {"plain-none", "plain-zstd", "int4-none", "int4-zstd"}
    assert tally.notes["check intact"] > 0 and tally.notes["check damaged"] > 0


# -- the harness catches what it is meant to catch --------------------------------------


def _flip_first_byte(real):
    def wrong(path, info):
        t = real(path, info)
        if t.numel():
            b = t.reshape(-1).view(__import__("torch").uint8)
            b[0] ^= 0xFF
        return t

    return wrong


@pytest.mark.parametrize("fault", ["crash", "wrong bytes"])
def test_fuzz_harness_reports_crashes_and_wrong_reads(tmp_path, monkeypatch, fault):
    import k3convert.checkpoint.reader as reader

    if fault == "crash":

        def boom(*a, **k):
            raise TypeError("injected")

        monkeypatch.setattr(reader, "_group", boom)
        want = "TypeError at "
    else:
        monkeypatch.setattr(reader, "map_tensor", _flip_first_byte(reader.map_tensor))
        want = "Mismatch: bytes differ from the file"
    tally = fuzz.run("checkpoint", seed=1, iterations=40, work=tmp_path)
    assert tally.n_crashes > 0 and any(s.startswith(want) for s in tally.crashes), tally.report()
    c = next(c for s, c in tally.crashes.items() if s.startswith(want))
    assert 0 <= c.iteration < 40 and c.mutation.startswith("[")


def test_fuzz_is_deterministic(tmp_path):
    a = fuzz.run("checkpoint", seed=3, iterations=60, work=tmp_path / "a")
    b = fuzz.run("checkpoint", seed=3, iterations=60, work=tmp_path / "b")
    assert (a.accepted, a.rejected, a.ops) == (b.accepted, b.rejected, b.ops)
    c = fuzz.run("checkpoint", seed=4, iterations=60, work=tmp_path / "c")
    assert (a.accepted, a.rejected, a.ops) != (c.accepted, c.rejected, c.ops)


def test_fuzz_cli_prints_counts(capsys):
    rc = fuzz.main(["--target", "checkpoint", "--iterations", "30", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[checkpoint] seed 1: 30 iterations" in out
    for line in ("accepted", "rejected", "SafetensorsFormatError", "crashes   0 at 0 site(s)"):
        assert line in out, out
