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
    assert tally.notes["foreign rank directory"] > 0  # each one rejected, or it is a crash


# -- the harness catches what it is meant to catch --------------------------------------


VLLM_ITERATIONS = 1000  # ~8 s, plus ~1 s to write the three templates


def test_fuzz_vllm_reader_and_writer(tmp_path):
    """The sharded_state directory (check + verify's inverse mapping: an accepted one
    holds the bytes written) and the writer over a damaged source (refused, or its output
    passes its own check; the source untouched and no stage left beside OUT)."""
    tally = fuzz.run("vllm", seed=SEED, iterations=VLLM_ITERATIONS, work=tmp_path)
    _assert_clean(tally, {"StreamCorruptError", "SafetensorsFormatError", "CheckpointError"})
    assert {o.split()[0] for o in tally.ops} == {"read", "write"}


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

        monkeypatch.setattr(reader, "group_parts", boom)
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


# -- the native kernels' wrappers, under ASan + UBSan ----------------------------------------
NATIVE_ITERATIONS = 3000  # ~12 s under the sanitizers


def _sanitizer_env(tmp_path: Path) -> tuple[Path, dict]:
    """fp4_kernels.c built with -fsanitize=address,undefined (every UB report fatal) and
    the environment that runs Python with the sanitizer runtimes preloaded; skips where
    the compiler or its sanitizer runtimes are missing."""
    import os
    import shlex
    import shutil
    import subprocess

    cc = shlex.split(os.environ.get("CC", "cc"))
    if shutil.which(cc[0]) is None:
        pytest.skip("no C compiler")
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        r = subprocess.run([*cc, f"-print-file-name={name}"], capture_output=True, text=True)
        if r.returncode or not Path(r.stdout.strip()).is_file():
            pytest.skip(f"{cc[0]} has no {name}")
        libs.append(r.stdout.strip())
    src = Path(__file__).resolve().parents[1] / "k3convert" / "native" / "fp4_kernels.c"
    lib = tmp_path / "fp4_kernels_asan.so"
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-g", "-O1",
             "-fno-omit-frame-pointer", "-std=c11", "-shared", "-fPIC", "-pthread"]  # fmt: skip
    subprocess.run([*cc, *flags, str(src), "-o", str(lib)], check=True, capture_output=True)
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(libs),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }
    return lib, env


def test_fuzz_native_wrappers_under_sanitizers(tmp_path):
    """Every native wrapper with valid and hostile arguments (bench/fuzz.py --target
    native) against an ASan + UBSan build of the kernels: every call returns (valid FP4
    decodes equal to the reference) or raises ValueError, and the sanitizers see no
    out-of-bounds access or undefined behaviour (either aborts the process)."""
    import subprocess

    lib, env = _sanitizer_env(tmp_path)
    cmd = [sys.executable, str(_PATH), "--target", "native", "--seed", str(SEED),
           "--iterations", str(NATIVE_ITERATIONS), "--native-lib", str(lib)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-4000:]
    assert f"[native] seed {SEED}: {NATIVE_ITERATIONS} iterations" in out, out
    assert "crashes   0 at 0 site(s)" in out, out
    accepted = int(out.split("accepted", 1)[1].split()[0])
    assert NATIVE_ITERATIONS // 10 < accepted < NATIVE_ITERATIONS * 9 // 10, out  # both outcomes
    for fn in ("gather", "max_codes", "fp4_decode", "mx_fp8_block", "gather_nib", "mx_int4"):
        assert f"ValueError ({fn})" in out, out


def test_sanitizer_build_catches_an_unchecked_call(tmp_path):
    """The harness above is not vacuous: the same build and environment abort on the
    call the FP4 decode wrapper now refuses (a 1-byte table passed straight to C)."""
    import subprocess

    lib, env = _sanitizer_env(tmp_path)
    code = (
        "import ctypes, torch, sys\n"
        f"sys.path.insert(0, {str(_PATH.parent)!r})\n"
        "import fuzz; from k3convert import native\n"
        f"fuzz.load_native_library({str(lib)!r})\n"
        "p = torch.zeros(8, 64, dtype=torch.uint8); c = torch.zeros(8, 4, dtype=torch.uint8)\n"
        "t = torch.zeros(1, dtype=torch.uint8); o = torch.empty(8, 128, dtype=torch.bfloat16)\n"
        "native._lib.k3_fp4_lut_bf16(p.data_ptr(), c.data_ptr(), 32, 16, t.data_ptr(),\n"
        "                            o.data_ptr(), 1, 1)\n"
        "print('not caught')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "not caught" not in r.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-2000:]
