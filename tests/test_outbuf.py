"""The decode output pool (k3convert/native/outbuf.py): memory is reused only once no
tensor uses it, the free list stays within its limit, and a bad setting is refused."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from k3convert import formats as fmt
from k3convert import native
from k3convert.errors import ConfigError
from k3convert.native import outbuf

MB = 1 << 20


def test_reused_after_the_last_view_dies():
    pool = outbuf.OutputPool(limit=64 * MB)
    a = pool.empty((1024, 1024), torch.float32)  # 4 MiB
    a.fill_(3.0)
    ptr = a.data_ptr()
    view = a[10:20]
    del a
    gc.collect()
    b = pool.empty((1024, 1024), torch.float32)
    assert b.data_ptr() != ptr and pool.hits == 0  # the view still holds the first buffer
    assert torch.all(view == 3.0)
    bptr = b.data_ptr()
    del view, b
    gc.collect()
    c = pool.empty((512, 2048), torch.float32)  # same rounded size, other shape
    assert pool.hits == 1 and c.data_ptr() in (ptr, bptr)  # one of the freed mappings
    assert c.shape == (512, 2048) and c.dtype == torch.float32 and c.is_contiguous()
    c.copy_(torch.arange(c.numel(), dtype=torch.float32).view(512, 2048))
    assert float(c[511, 2047]) == c.numel() - 1


def test_free_list_within_its_limit_and_off_at_zero():
    pool = outbuf.OutputPool(limit=6 * MB)
    ts = [pool.empty((MB,), torch.uint8) for _ in range(5)]  # 1 MiB each, 2 MiB mappings
    del ts
    gc.collect()
    assert pool.held == 6 * MB  # three kept, two unmapped
    off = outbuf.OutputPool(limit=0)
    t = off.empty((4 * MB,), torch.uint8)
    del t
    gc.collect()
    assert off.held == 0 and off.hits == off.misses == 0
    small = pool.empty((100,), torch.bfloat16)  # below MIN_BYTES: torch's own
    assert small.shape == (100,) and pool.misses == 5


def test_bad_pool_setting_is_refused(monkeypatch):
    monkeypatch.setenv("K3CONVERT_OUTPUT_POOL", "lots")
    with pytest.raises(ConfigError, match="K3CONVERT_OUTPUT_POOL='lots'"):
        outbuf.OutputPool()
    monkeypatch.setenv("K3CONVERT_OUTPUT_POOL", "-1")
    with pytest.raises(ConfigError, match="not a byte count"):
        outbuf.OutputPool()
    monkeypatch.setenv("K3CONVERT_OUTPUT_POOL", "0")
    assert outbuf.OutputPool().limit == 0


def test_threads_never_share_a_live_buffer():
    pool = outbuf.OutputPool(limit=32 * MB)
    errors = []

    def work(k: int) -> None:
        for i in range(40):
            t = pool.empty((MB // 2,), torch.int32)  # 2 MiB
            t.fill_(k * 1000 + i)
            if not bool(torch.all(t == k * 1000 + i)):
                errors.append((k, i))
            del t

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and pool.hits > 0


@pytest.mark.skipif(native.library() is None, reason="no native kernels")
def test_decodes_through_reused_memory_stay_exact():
    """Decode, drop, decode again into the same pages: the reference's bits each time (a
    kernel that skipped a byte would show the previous tensor's values here)."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        for seed in range(3):
            packed = torch.randint(0, 256, (256, 2048), generator=g, dtype=torch.uint8)
            codes = torch.randint(110, 130, (256, 128), generator=g, dtype=torch.uint8)
            p = {"weight_packed": packed, "weight_scale": codes}
            got = fmt.fp4.decode_mxfp4(p, fmt.QuantParams(), dtype)
            want = fmt.mxfp4_reference(p, fmt.QuantParams(), dtype)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, seed)
            del got
            gc.collect()
    assert outbuf.pool().hits > 0
