"""The fast paths of quantize and the stream writer give exactly what the general ones do.

- the fused fp8-block and symmetric int kernels against the general (banded float32)
  code, bit for bit, over dtypes, shapes (with and without edge blocks) and odd values,
  and their hand-over to the general path where it decides (NaN, overflowing scales);
- the positional SafetensorsWriter (tensors written at their place, from threads, in any
  order; kept tensors copied by the kernel) read back by safetensors' own loader;
- quantize output byte-identical whatever the number of workers;
- the inline check of a safetensors header entry against the general checker: the same
  tensor info or the same error, over random well- and ill-formed entries.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3convert.checkpoint.safetensors_io import SafetensorsWriter, map_chunks, read_header
from k3convert.pipeline import quantize
from k3convert.quant.schemes import NonFiniteWeightError, get_scheme
from tests.models import save_model

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[: min(128, shape[0]), : min(128, shape[1])] = 0  # an all-zero block / group
    w[-1, :7] *= 1e-6  # tiny values next to ordinary ones
    w[0, -1] = -0.0
    return w.to(dtype)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        x, y = a[k], b[k]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (384, 1024)])
def test_fp8_block_fused_path_is_the_general_one(dtype, shape):
    s = get_scheme("fp8-block")
    w = _weights(shape, dtype)
    fast = s._quantize_whole_blocks(w)
    assert fast is not None
    _same(fast, s._quantize_blocks_general(w, "w"))


@pytest.mark.parametrize("shape", [(200, 384), (256, 300), (1, 128)])
def test_fp8_block_edge_blocks_take_the_general_path(shape):
    s = get_scheme("fp8-block")
    w = _weights(shape, torch.bfloat16)
    assert s._quantize_whole_blocks(w) is None
    _same(s.quantize(w), s._quantize_blocks_general(w, "w"))


def test_fp8_block_hands_over_nan_and_huge_values():
    s = get_scheme("fp8-block")
    w = _weights((256, 256), torch.float32)
    w[3, 5] = float("nan")
    assert s._quantize_whole_blocks(w) is None
    with pytest.raises(NonFiniteWeightError, match=r"'layer\.w'"):
        s.quantize(w, name="layer.w")
    w[3, 5] = torch.finfo(torch.float32).max  # the largest finite weight: still exact
    fast = s._quantize_whole_blocks(w)
    assert fast is not None and bool(torch.isfinite(fast["weight_scale"]).all())
    _same(fast, s._quantize_blocks_general(w, "w"))
    ue8m0 = get_scheme("fp8-block-ue8m0")  # power-of-two scales: the general path's
    assert ue8m0._quantize_whole_blocks(w) is None


@pytest.mark.parametrize("name", ["w4a16", "w3a16", "w2a16", "int8-g64", "w8a8", "int4-g32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(130, 384), (1, 256), (512, 128)])
def test_symmetric_int_fused_path_is_the_general_one(name, dtype, shape):
    s = get_scheme(name)
    w = _weights(shape, dtype, seed=shape[0])
    fast = s._quantize_symmetric(w)
    assert fast is not None
    _same(fast, s.quantize_general(w, "w"))


def test_symmetric_int_hands_over_inf_and_overflowing_scales():
    s = get_scheme("w4a16")
    w = _weights((64, 256), torch.float32)
    w[1, 2] = float("inf")
    assert s._quantize_symmetric(w) is None
    with pytest.raises(NonFiniteWeightError):
        s.quantize(w)
    w[1, 2] = 3.3e38  # finite, but its bf16 scale times q_min overflows
    assert s._quantize_symmetric(w) is None
    out = s.quantize(w)
    assert bool(torch.isfinite(out["weight_scale"].float()).all())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    small = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4)
    return save_model("llama", tmp_path_factory.mktemp("llama") / "m", **small)


def _entries(tensors):
    return [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]


def test_positional_writes_from_threads_read_back_by_safetensors(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "b": torch.randint(-8, 8, (5, 3), generator=g, dtype=torch.int32),
        "c": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "d": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
    }
    src = tmp_path / "src.safetensors"
    save_file({"k": tensors["a"]}, src)
    out = tmp_path / "out.safetensors"
    with SafetensorsWriter(out, _entries(tensors), {"format": "pt"}) as w:
        info = read_header(src).tensors["k"]
        jobs = [threading.Thread(target=w.put, args=(k, tensors[k])) for k in ("d", "c", "b")]
        jobs.append(threading.Thread(target=w.copy_from, args=("a", src, info)))
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        w.put("empty", tensors["empty"])
    back = load_file(out)
    for k, v in tensors.items():
        got, want = back[k], v
        if v.dtype == torch.float8_e4m3fn:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), k


def test_positional_writer_refuses_twice_missing_and_mixed(tmp_path):
    t = {"a": torch.zeros(2), "b": torch.ones(3)}
    w = SafetensorsWriter(tmp_path / "x.safetensors", _entries(t))
    w.put("a", t["a"])
    with pytest.raises(ValueError, match="written twice"):
        w.put("a", t["a"])
    with pytest.raises(ValueError, match="header says"):
        w.put("b", torch.ones(4))
    with pytest.raises(ValueError, match="sequential writes after positional"):
        w.write("b", t["b"])
    with pytest.raises(ValueError, match="closed before tensor 'b'"):
        w.close()


def test_sequential_writer_takes_empty_tensors(tmp_path):
    t = {"e": torch.empty(0, 3), "x": torch.arange(4.0)}
    with SafetensorsWriter(tmp_path / "e.safetensors", _entries(t)) as w:
        for k, v in t.items():
            w.write(k, v)
    back = load_file(tmp_path / "e.safetensors")
    assert back["e"].shape == (0, 3) and torch.equal(back["x"], t["x"])


def test_sequential_writes_in_runs_hash_the_file_as_written(tmp_path, monkeypatch):
    """Tensors larger than a write run (7 bytes here: run boundaries inside values and
    inside the header, stacked parts too) give the file one write each gives, safetensors
    reads it back, and the digest is the file's."""
    import xxhash

    from k3convert.checkpoint import safetensors_io

    t = {"a": torch.randn(5, 3, dtype=torch.bfloat16), "b": torch.arange(11, dtype=torch.int32)}

    def write(path, runs):
        monkeypatch.setattr(safetensors_io, "EMIT_BYTES", runs)
        digest = xxhash.xxh3_128()
        with SafetensorsWriter(path, _entries(t), {"format": "pt"}, digest=digest) as w:
            w.write("a", t["a"])
            w.write_stacked("b", [t["b"][:4], t["b"][4:]])
        return path.read_bytes(), digest.hexdigest()

    data, digest = write(tmp_path / "r.safetensors", 7)
    assert (data, digest) == write(tmp_path / "whole.safetensors", 1 << 30)
    assert digest == xxhash.xxh3_128(data).hexdigest()
    back = load_file(tmp_path / "r.safetensors")
    assert all(torch.equal(back[k], v) for k, v in t.items())


def test_kernel_copy_falls_back_to_reads_and_writes(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    big = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB: more than one 8 MiB piece
    src = tmp_path / "s.safetensors"
    save_file({"t": big}, src)
    out = tmp_path / "o.safetensors"
    with SafetensorsWriter(out, _entries({"t": big})) as w:
        w.copy_from("t", src, read_header(src).tensors["t"])
    assert torch.equal(load_file(out)["t"], big)


def test_map_chunks_cover_a_tensor_exactly(tmp_path):
    t = torch.arange(10_001, dtype=torch.float16)
    p = tmp_path / "m.safetensors"
    save_file({"t": t}, p)
    info = read_header(p).tensors["t"]
    chunks = list(map_chunks(p, info, chunk_bytes=4097))  # not a multiple of the item size
    assert all(c.numel() * 2 <= 4097 for c in chunks) and len(chunks) == 5
    assert torch.equal(torch.cat(chunks), t)


@pytest.mark.parametrize("scheme", ["fp8-block", "w4a16"])
def test_output_bytes_do_not_depend_on_workers(llama, tmp_path, scheme):
    outs = []
    for n in (1, 3):
        out = tmp_path / f"w{n}"
        quantize(src=llama, out=out, scheme=scheme, workers=n, shard_size=300_000, progress=False)
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    for n in names:
        if n == "config.json":  # records the source path only; same for both
            a, b = (json.loads((o / n).read_text()) for o in outs)
            assert a == b
        else:
            assert (outs[0] / n).read_bytes() == (outs[1] / n).read_bytes(), n


def test_torch_threads_restored_after_parallel_quantize(llama, tmp_path):
    before = torch.get_num_threads()
    quantize(src=llama, out=tmp_path / "o", scheme="fp8-block", workers=2, progress=False)
    assert torch.get_num_threads() == before


def test_header_entry_fast_path_agrees_with_the_checker():
    """``_parse_entry`` takes well-formed entries inline and hands the rest to
    ``_checked_entry``: over 20 000 random entries (bad dtypes, bools, floats, negative,
    huge and too many dims, wrong byte counts, missing keys), both give the same
    ``RawTensorInfo`` or raise the same message."""
    import math
    import random
    from pathlib import Path

    from k3convert.checkpoint import safetensors_io as sio

    rng = random.Random(0)
    odd = [0, 1, 7, 2**31 - 1, 2**31, 2**62, 2**63, -1, True, False, 1.0, "1", None, [1]]
    dtypes = [*sio.ST_DTYPES, "X", 1, None]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(20_000):
        shape = [rng.choice(odd) if rng.random() < 0.2 else rng.randint(0, 40)
                 for _ in range(rng.randint(0, 6))]  # fmt: skip
        if rng.random() < 0.05:
            shape = rng.choice(odd)
        st = rng.choice(dtypes)
        a = rng.choice(odd) if rng.random() < 0.1 else rng.randint(0, 100)
        n = rng.randint(0, 50)
        ints = isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**40 for d in shape)
        if st in sio.ST_DTYPES and ints:
            n = -(-math.prod(shape) * sio.ST_DTYPES[st][1] // 8)
        b = a + n if type(a) is int and rng.random() < 0.8 else rng.choice(odd)
        entry = {
            "dtype": st,
            "shape": shape,
            "data_offsets": [a, b] if rng.random() < 0.95 else [a],
        }
        if rng.random() < 0.03:
            del entry["dtype"]
        got = []
        for f in (sio._parse_entry, sio._checked_entry):
            try:
                got.append(f(Path("m.safetensors"), "t", entry, 5))
            except sio.SafetensorsFormatError as e:
                got.append(str(e))
        assert got[0] == got[1], entry
        outcomes["error" if isinstance(got[0], str) else "ok"] += 1
    assert min(outcomes.values()) > 5000, outcomes  # both paths well exercised
