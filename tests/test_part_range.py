"""``shard.split.part_range`` - how the vLLM writer's Slicer maps a rank's rows or
columns onto each stored part - against ``split_tensor``, the stream's cut of the same
tensor: the same part ranges wherever the stream splits, a refusal wherever it refuses."""

from __future__ import annotations

import pytest

from k3convert.checkpoint import open_checkpoint
from k3convert.pipeline import quantize
from k3convert.shard.split import part_range, split_tensor
from k3convert.stream.format import SplitError
from k3convert.synth import synthesize

SCHEMES = ("fp8-block", "fp8-dynamic", "w8a8", "int4-g32-asym", "int8-g32-asym", "nvfp4a16")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("pr")
    src = root / "m"
    # inputs of 256 and 384: whole 128-column FP8 blocks; 384 / 8 cuts a group of 32
    shape = {"hidden": 256, "heads": 8, "kv_heads": 2, "intermediate": 384, "layers": 1}
    synthesize(config="llama3-8b", out=src, tiny=True, overrides=shape)
    out = {}
    for scheme in SCHEMES:
        out[scheme] = root / scheme
        quantize(src=src, out=out[scheme], scheme=scheme, progress=False)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_part_range_is_the_streams_cut(sources, scheme):
    ck = open_checkpoint(sources[scheme])
    checked = refused = 0
    for name in ck.names():
        m = ck.meta(name)
        if m.encoding == "plain" or len(m.shape) != 2:
            continue
        for d in (0, 1):
            for n in (2, 3, 4, 8):
                try:
                    pieces = split_tensor(m, d, n)
                except SplitError:
                    pieces = None
                bounds = [(k * m.shape[d] // n, (k + 1) * m.shape[d] // n) for k in range(n)]
                if pieces is None:  # the stream refuses: so does some part at some boundary
                    if m.shape[d] % n:
                        continue  # (uneven: the callers never ask for it)
                    with pytest.raises(SplitError, match="would cut"):
                        for a, b in bounds:
                            for part in m.parts:
                                part_range(m, part, d, a, b)
                    refused += 1
                    continue
                for piece in pieces:
                    a, b = piece.start, piece.start + piece.length
                    for ps in piece.parts:
                        got = part_range(m, ps.part, d, a, b)
                        want = None if ps.dim is None else (ps.start, ps.start + ps.length)
                        assert got == want, (name, ps.part, d, n, piece.index)
                checked += 1
    assert checked >= 12
    if scheme in ("fp8-block", "int4-g32-asym", "int8-g32-asym"):
        assert refused > 0  # some degree cuts a block, a packed word or a group
