"""Checkpoint readers against what transformers / the public formats actually wrote.

Oracles: the bytes transformers saved (decoded by hand and through safetensors'
safe_open), dequantizations written here from the format descriptions (not the
library's), compressed-tensors' own decompressor, hashlib. Corrupt inputs are crafted
by editing safetensors header bytes directly.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3convert import arch as A
from k3convert.checkpoint import open_checkpoint, read_header
from k3convert.errors import (
    ArchError,
    CheckpointError,
    K3Error,
    SafetensorsFormatError,
    UnknownTensorsError,
    UnsafePickleError,
)
from tests.conftest import FAMILIES
from tests.encode import (
    E4M3_MAX,
    append_mtp_layer,
    encode_fp8_block,
    encode_pack_quantized,
    is_linear_weight,
    is_routed_expert,
    load_state,
    raw_tensor,
    read_raw,
    reshard,
    to_bin,
    write_raw,
)
from tests.models import build_model

# A DeepSeek-V3 whose Linear dims are not multiples of 128: several FP8 blocks per
# weight, with partial edge blocks on both axes (200 = 128 + 72, 300 = 2*128 + 44 ...).
BIG_DSV3 = dict(
    hidden_size=200,
    intermediate_size=300,
    moe_intermediate_size=136,
    q_lora_rank=160,
    kv_lora_rank=144,
    n_routed_experts=4,
    num_hidden_layers=2,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparison (NaN-safe, -0.0-safe)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (what, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), f"{what}: bytes differ"


def st_file(d: Path) -> Path:
    return d / "model.safetensors"


# -- plain checkpoints as transformers wrote them -----------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_read_back_bitwise(tiny_models, family):
    d = tiny_models[family]
    f = st_file(d)
    ck = open_checkpoint(d)
    with safe_open(f, "pt") as sf:
        keys = list(sf.keys())
        assert sorted(ck.names()) == sorted(keys)
        for n in keys:
            m = ck.meta(n)
            ref = sf.get_tensor(n)
            assert m.encoding == "plain"
            assert m.shape == tuple(ref.shape) and m.dtype == ref.dtype
            assert m.file == f and m.nbytes == ref.numel() * ref.element_size()
            got = ck.get(n)
            assert_bitwise(got, ref, n)
            assert_bitwise(got, raw_tensor(f, n), n)  # hand-decoded bytes
            assert_bitwise(ck.get_parts(n)["weight"], ref, n)
    assert len(ck) == len(keys)
    assert ck.config == json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_plain_equals_model_parameters(tiny_models, family):
    """The same values as the in-memory transformers model that was saved."""
    ck = open_checkpoint(tiny_models[family])
    sd = build_model(family).state_dict()
    common = [n for n in ck.names() if n in sd]
    assert len(common) >= 10
    for n in common:
        assert_bitwise(ck.get(n), sd[n].contiguous(), n)


def test_fixture_perturbs_e_score_correction_bias(tiny_models):
    """tests/models.py must randomise e_score_correction_bias (a buffer in transformers),
    or a reader that drops or swaps it cannot be caught."""
    ck = open_checkpoint(tiny_models["deepseek_v3"])
    b = ck.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert b.abs().sum() > 0, "fixture saved e_score_correction_bias as all zeros"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_bitwise_and_cast(model_factory, dtype):
    d = model_factory("llama", dtype=dtype)
    ck = open_checkpoint(d)
    with safe_open(st_file(d), "pt") as sf:
        for n in list(sf.keys()):
            ref = sf.get_tensor(n)
            assert ref.dtype == dtype
            assert_bitwise(ck.get(n), ref, n)
            assert_bitwise(ck.get(n, dtype=torch.float32), ref.float(), n)
            assert ck.meta(n).storage == str(dtype).removeprefix("torch.")


def test_names_in_storage_order(tiny_models):
    d = tiny_models["deepseek_v3"]
    header, _ = read_raw(st_file(d))
    header.pop("__metadata__", None)
    by_offset = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    assert open_checkpoint(d).names() == by_offset


def test_read_header_matches_file(tiny_models):
    f = st_file(tiny_models["mixtral"])
    h = read_header(f)
    header, data = read_raw(f)
    meta = header.pop("__metadata__", {})
    assert h.metadata == meta and h.file_size == f.stat().st_size
    base = f.stat().st_size - len(data)
    assert h.header_len == base - 8
    for n, e in header.items():
        t = h.tensors[n]
        assert list(t.shape) == e["shape"]
        assert (t.start - base, t.end - base) == tuple(e["data_offsets"])


def test_returned_tensors_never_write_back(tiny_models):
    """Tensors are copy-on-write views: editing one changes neither the file nor a
    later read."""
    d = tiny_models["mixtral"]
    before = hashlib.sha256(st_file(d).read_bytes()).hexdigest()
    ck = open_checkpoint(d)
    n = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    ref = ck.get(n).clone()
    t = ck.get(n)
    t.add_(1.0)
    del t
    assert_bitwise(ck.get(n), ref, n)
    assert hashlib.sha256(st_file(d).read_bytes()).hexdigest() == before


def test_iter_tensors_matches_get(tiny_models):
    ck = open_checkpoint(tiny_models["qwen3"])
    seen = []
    for n, t in ck.iter_tensors(dtype=torch.bfloat16):
        assert t.dtype == torch.bfloat16
        assert_bitwise(t, ck.get(n).to(torch.bfloat16), n)
        seen.append(n)
    assert seen == ck.names()


def test_bad_config_json(tiny_models, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(st_file(tiny_models["llama"]).read_bytes())
    (d / "config.json").write_text('{"model_type": "llama",')
    _expect(d, CheckpointError, "config.json")


def test_unknown_tensor_name_in_get(tiny_models):
    ck = open_checkpoint(tiny_models["llama"])
    with pytest.raises(CheckpointError, match=r"model\.no_such\.weight"):
        ck.get("model.no_such.weight")


def test_single_file_path(tiny_models):
    f = st_file(tiny_models["qwen3"])
    ck = open_checkpoint(f)
    with safe_open(f, "pt") as sf:
        assert sorted(ck.names()) == sorted(sf.keys())
        n = "model.embed_tokens.weight"
        assert_bitwise(ck.get(n), sf.get_tensor(n))
    assert ck.config["model_type"] == "qwen3"


# -- FP8 block (DeepSeek-V3 / Kimi-K2) ------------------------------------------------


def fp8_dequant_reference(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """weight * scale_inv, one block at a time (the format description, literally)."""
    b0, b1 = block
    out, inp = q.shape
    assert tuple(s.shape) == (math.ceil(out / b0), math.ceil(inp / b1))
    w = q.float()
    res = torch.empty(out, inp)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            res[rs, cs] = w[rs, cs] * s[i, j].float()
    return res


FP8_CASES = [
    ("big_dsv3", (128, 128), "float32"),
    ("big_dsv3", (128, 128), "ue8m0"),
    ("big_dsv3", (128, 128), "e8m0"),
    ("kimi_k25", (32, 48), "float32"),
    ("qwen3_moe", (128, 128), "ue8m0"),
]


@pytest.fixture(scope="module")
def fp8_dirs(tiny_models, model_factory, tmp_path_factory):
    """(source, block, scale_fmt) -> (original dir, FP8-block re-encoded dir), lazily."""
    cache: dict = {}

    def get(src: str, block, fmt):
        key = (src, block, fmt)
        if key not in cache:
            if src == "big_dsv3":
                orig = model_factory("deepseek_v3", **BIG_DSV3)
            else:
                orig = tiny_models[src]
            dst = tmp_path_factory.mktemp("fp8") / "model"
            cache[key] = (orig, encode_fp8_block(orig, dst, block=block, scale_fmt=fmt))
        return cache[key]

    return get


@pytest.mark.parametrize(("src", "block", "fmt"), FP8_CASES)
def test_fp8_block_read_back(fp8_dirs, src, block, fmt):
    orig_dir, d = fp8_dirs(src, block, fmt)
    orig = load_state(orig_dir)
    ck = open_checkpoint(d)
    assert sorted(ck.names()) == sorted(orig)  # logical names only: scales are parts
    n_enc = 0
    with safe_open(st_file(d), "pt") as sf:
        for n, w in orig.items():
            m = ck.meta(n)
            if not is_linear_weight(n, tuple(w.shape)):
                assert m.encoding == "plain", n
                assert_bitwise(ck.get(n), w, n)
                continue
            n_enc += 1
            q = sf.get_tensor(n)
            s = sf.get_tensor(n.removesuffix("weight") + "weight_scale_inv")
            assert m.encoding == "fp8-block", n
            assert set(m.parts) == {"weight", "weight_scale_inv"}
            assert m.shape == tuple(w.shape) and m.dtype == torch.float8_e4m3fn
            assert m.storage == "float8_e4m3fn" and m.quant.block == block
            parts = ck.get_parts(n)
            assert_bitwise(parts["weight"], q, n)
            assert_bitwise(parts["weight_scale_inv"], s, n)
            if fmt == "e8m0":
                assert s.dtype == torch.float8_e8m0fnu
            sf32 = s.float()
            if fmt != "float32":  # powers of two
                assert torch.equal(sf32, torch.exp2(torch.log2(sf32).round()))
            got = ck.get(n)
            assert got.dtype == torch.float32
            assert_bitwise(got, fp8_dequant_reference(q, s, block), n)
            assert_bitwise(ck.get(n, dtype=torch.bfloat16), got.to(torch.bfloat16), n)
            # e4m3: 3 mantissa bits (relative error <= 2**-4), subnormal step 2**-9
            full = sf32.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            full = full[: w.shape[0], : w.shape[1]]
            bound = w.abs() * 2**-4 + full * 2**-10
            err = (got - w).abs()
            assert bool((err <= bound * 1.0001).all()), (n, float((err - bound).max()))
            assert float((got / full).abs().max()) <= E4M3_MAX * (1 + 1e-6)
    assert n_enc >= 8
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert cfg["weight_block_size"] == list(block)


def test_fp8_partial_edge_blocks_exercised(fp8_dirs):
    _, d = fp8_dirs("big_dsv3", (128, 128), "float32")
    ck = open_checkpoint(d)
    shapes = {ck.meta(n).shape for n in ck.names() if ck.meta(n).encoding == "fp8-block"}
    assert any(o % 128 and i % 128 and o > 128 and i > 128 for o, i in shapes)
    grids = {tuple(ck.meta(n).parts["weight_scale_inv"].shape) for n in ck.names()
             if ck.meta(n).encoding == "fp8-block"}  # fmt: skip
    assert (3, 2) in grids and (2, 3) in grids


def test_fp8_arch_sees_logical_names(fp8_dirs):
    _, d = fp8_dirs("kimi_k25", (32, 48), "float32")
    ck = open_checkpoint(d)
    a, cfg = A.resolve(ck.config)
    roles = a.classify(cfg, ck.names())
    assert len(roles) == len(ck.names())
    shapes = a.expected_shapes(cfg, ck.names())
    assert all(shapes[n] == ck.meta(n).shape for n in ck.names())


def test_fp8_weight_and_scale_in_different_shards(fp8_dirs, tmp_path):
    _, d = fp8_dirs("big_dsv3", (128, 128), "float32")
    sh = reshard(d, tmp_path / "sharded", n_files=3, interleave=True)
    a, b = open_checkpoint(d), open_checkpoint(sh)
    assert a.names() != b.names() and sorted(a.names()) == sorted(b.names())
    split = 0
    for n in a.names():
        mb = b.meta(n)
        assert mb.encoding == a.meta(n).encoding
        assert_bitwise(b.get(n), a.get(n), n)
        if mb.encoding == "fp8-block":
            split += mb.parts["weight"].file != mb.parts["weight_scale_inv"].file
    assert split > 0


def test_fp8_scale_shape_mismatch_is_an_error(fp8_dirs, tmp_path):
    _, d = fp8_dirs("big_dsv3", (128, 128), "float32")
    state = load_state(d)
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"  # [2, 3] for [200, 300]
    state[name] = torch.ones(2, 2)
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(out)
    assert "model.layers.0.mlp.down_proj.weight" in str(ei.value)


def test_fp8_weight_without_scale_is_an_error(fp8_dirs, tmp_path):
    """Under quant_method fp8, an e4m3 weight that lost its weight_scale_inv must not
    read as plain float8 values (silently wrong by the block scale)."""
    _, d = fp8_dirs("big_dsv3", (128, 128), "float32")
    state = load_state(d)
    del state["model.layers.0.mlp.down_proj.weight_scale_inv"]
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError) as ei:
        ck = open_checkpoint(out)
        ck.get("model.layers.0.mlp.down_proj.weight")
    assert "model.layers.0.mlp.down_proj.weight" in str(ei.value)


# -- compressed-tensors pack-quantized int4 (Kimi-K2-Thinking) ------------------------


def unpack_reference(packed: torch.Tensor, num_bits: int, n: int) -> np.ndarray:
    """Rows of int32 words -> rows of ``n`` signed values: value i is bits
    [i*b, (i+1)*b) of the row's little-endian bit stream, offset by 2**(b-1)."""
    words = packed.contiguous().numpy().astype("<i4")
    rows = words.shape[0]
    stream = np.unpackbits(words.view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
    vals = stream[:, : n * num_bits].reshape(rows, n, num_bits).astype(np.int64)
    vals = (vals << np.arange(num_bits)).sum(-1)
    return vals - (1 << (num_bits - 1))


def int_dequant_reference(sf, base: str, num_bits: int, group: int) -> torch.Tensor:
    shape = tuple(int(x) for x in sf.get_tensor(base + "weight_shape").tolist())
    out, inp = shape
    q = unpack_reference(sf.get_tensor(base + "weight_packed"), num_bits, inp)
    scale = sf.get_tensor(base + "weight_scale").float()
    n_groups = scale.shape[1]
    assert n_groups == math.ceil(inp / group)
    if base + "weight_zero_point" in set(sf.keys()):
        zp_packed = sf.get_tensor(base + "weight_zero_point")  # packed along dim 0
        zp = unpack_reference(zp_packed.t(), num_bits, out).T
    else:
        zp = np.zeros((out, n_groups), dtype=np.int64)
    res = torch.empty(out, inp)
    for g in range(n_groups):
        cs = slice(g * group, (g + 1) * group)
        ints = torch.from_numpy(q[:, cs] - zp[:, g : g + 1]).float()
        res[:, cs] = ints * scale[:, g : g + 1]
    return res


INT4_CASES = [
    ("kimi_k25", "experts", True),
    ("qwen3_moe_odd", "experts", False),  # out=20: zero points fill a partial int32 word
    ("deepseek_v3", "experts", False),
    ("qwen3_moe", "linear", True),
    ("mixtral", "linear", False),
]


def _int4_source(family, tiny_models, model_factory):
    if family == "qwen3_moe_odd":
        return model_factory("qwen3_moe", moe_intermediate_size=20)
    return tiny_models[family]


@pytest.fixture(scope="module")
def int4_dirs(tiny_models, model_factory, tmp_path_factory):
    cache: dict = {}

    def get(family, scope, sym):
        key = (family, scope, sym)
        if key not in cache:
            dst = tmp_path_factory.mktemp("int4") / "model"
            src = _int4_source(family, tiny_models, model_factory)
            cache[key] = encode_pack_quantized(src, dst, scope=scope, symmetric=sym)
        return cache[key]

    return get


@pytest.mark.parametrize(("family", "scope", "sym"), INT4_CASES)
def test_int4_read_back(tiny_models, model_factory, int4_dirs, family, scope, sym):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    d = int4_dirs(family, scope, sym)
    orig = load_state(_int4_source(family, tiny_models, model_factory))
    ck = open_checkpoint(d)
    qc = QuantizationConfig.model_validate(ck.config["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert sorted(ck.names()) == sorted(orig)
    pick = is_routed_expert if scope == "experts" else is_linear_weight
    n_enc = 0
    with safe_open(st_file(d), "pt") as sf:
        for n, w in orig.items():
            m = ck.meta(n)
            if not (pick(n, tuple(w.shape)) and w.shape[1] % 32 == 0):
                assert m.encoding == "plain", n
                assert_bitwise(ck.get(n), w, n)
                continue
            n_enc += 1
            base = n.removesuffix("weight")
            assert m.encoding == "pack-quantized", n
            want = {"weight_packed", "weight_scale", "weight_shape"}
            assert set(m.parts) == (want if sym else want | {"weight_zero_point"})
            assert m.shape == tuple(w.shape) and m.dtype == torch.int32
            assert m.storage == "int4" and m.quant.num_bits == 4
            assert m.quant.block == (1, 32) and m.quant.symmetric is sym
            got = ck.get(n)
            ref = int_dequant_reference(sf, base, 4, 32)
            assert_bitwise(got, ref, n)
            # compressed-tensors' own decompressor (bf16 arithmetic, like its scales)
            sd = {p: sf.get_tensor(base + p) for p in m.parts}
            ct = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
            assert_bitwise(ct, ref.to(ct.dtype), n)
            # within the format's error: half a step (symmetric; one step asymmetric,
            # where the rounded zero point shifts the grid), plus the clipping the
            # bf16-rounded scale (relative error <= 2**-8) adds at the range ends.
            scale = sd["weight_scale"].float().repeat_interleave(32, 1)[:, : w.shape[1]]
            bound = scale * ((0.5 + 7.5 * 2**-8) if sym else (1 + 15 * 2**-8)) * 1.001
            assert bool(((got - w).abs() <= bound).all()), n
    assert n_enc >= 16


def test_int4_weight_shape_mismatch_is_an_error(int4_dirs, tmp_path):
    d = int4_dirs("deepseek_v3", "experts", False)
    state = load_state(d)
    name = "model.layers.1.mlp.experts.3.up_proj.weight_shape"
    state[name] = torch.tensor([32, 96])  # packed holds 64 columns
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError) as ei:
        ck = open_checkpoint(out)
        ck.get("model.layers.1.mlp.experts.3.up_proj.weight")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(ei.value)


# -- layouts: index shards, torch .bin ------------------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_sharded_with_index_reads_identically(tiny_models, tmp_path, family):
    d = tiny_models[family]
    sh = reshard(d, tmp_path / "sh", n_files=3)
    a, b = open_checkpoint(d), open_checkpoint(sh)
    wm = json.loads((sh / "model.safetensors.index.json").read_text())["weight_map"]
    assert [f.path.name for f in b.files()] == sorted(set(wm.values()))
    assert a.names() == b.names()
    for n in a.names():
        assert b.meta(n).file.name == wm[n]
        assert_bitwise(b.get(n), a.get(n), n)
    assert b.config == a.config


def test_index_wins_over_stray_files(tiny_models, tmp_path):
    """Only the files the index names are read (a stale single file is ignored)."""
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    save_file({"junk": torch.zeros(3)}, sh / "stale.safetensors")
    ck = open_checkpoint(sh)
    assert "junk" not in ck.names() and len(ck.files()) == 2


@pytest.mark.parametrize("n_files", [1, 2])
def test_torch_bin_reads_identically(tiny_models, tmp_path, n_files):
    d = tiny_models["qwen3_moe"]
    b = to_bin(d, tmp_path / "bin", n_files=n_files)
    assert not list(b.glob("*.safetensors"))
    ref = load_state(d)
    ck = open_checkpoint(b)
    assert sorted(ck.names()) == sorted(ref)
    assert all(f.path.suffix == ".bin" for f in ck.files()) and len(ck.files()) == n_files
    for n, t in ref.items():
        assert ck.meta(n).shape == tuple(t.shape)
        assert_bitwise(ck.get(n), t, n)


def test_sha256_matches_hashlib(tiny_models, tmp_path):
    sh = reshard(tiny_models["mixtral"], tmp_path / "sh", n_files=3)
    ck = open_checkpoint(sh)
    assert len(ck.files()) == 3
    for fi in ck.files():
        data = fi.path.read_bytes()
        assert fi.size == len(data)
        assert ck.sha256(fi.path) == hashlib.sha256(data).hexdigest()
        assert ck.sha256(str(fi.path)) == hashlib.sha256(data).hexdigest()


def test_aux_files_listed(tiny_models):
    ck = open_checkpoint(tiny_models["llama"])
    assert [p.name for p in ck.aux_files] == ["generation_config.json"]


# -- corrupt safetensors, crafted by editing the header bytes --------------------------


@pytest.fixture
def st_copy(tiny_models, tmp_path):
    """A writable copy of the llama fixture: (dir, its safetensors file)."""
    src = tiny_models["llama"]
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    f = d / "model.safetensors"
    f.write_bytes(st_file(src).read_bytes())
    return d, f


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][0])  # fmt: skip


def _rewrite(f: Path, header: dict | str, data: bytes) -> None:
    """New header, same data region (offsets are relative to the data start)."""
    write_raw(f, header, data)


def _expect(d: Path, exc, *needles: str) -> str:
    with pytest.raises(exc) as ei:
        open_checkpoint(d)
    msg = str(ei.value)
    for s in needles:
        assert s in msg, f"{s!r} not in error message: {msg}"
    return msg


def test_truncated_data(st_copy):
    d, f = st_copy
    f.write_bytes(f.read_bytes()[:-10])
    msg = _expect(d, SafetensorsFormatError, f.name)
    assert "truncated" in msg


def test_truncated_inside_header(st_copy):
    d, f = st_copy
    f.write_bytes(f.read_bytes()[:100])
    _expect(d, SafetensorsFormatError, f.name)


def test_truncated_below_length_prefix(st_copy):
    d, f = st_copy
    f.write_bytes(b"\x10\x00\x00")
    _expect(d, SafetensorsFormatError, f.name)


def test_header_length_past_end_of_file(st_copy):
    d, f = st_copy
    blob = bytearray(f.read_bytes())
    blob[:8] = struct.pack("<Q", len(blob))  # one header byte more than the file holds
    f.write_bytes(bytes(blob))
    msg = _expect(d, SafetensorsFormatError, f.name)
    assert str(len(blob)) in msg


def test_header_length_absurd(st_copy):
    d, f = st_copy
    blob = bytearray(f.read_bytes())
    blob[:8] = struct.pack("<Q", 1 << 62)
    f.write_bytes(bytes(blob))
    _expect(d, SafetensorsFormatError, f.name)


def test_header_not_json(st_copy):
    d, f = st_copy
    blob = bytearray(f.read_bytes())
    blob[8] = ord("#")
    f.write_bytes(bytes(blob))
    _expect(d, SafetensorsFormatError, f.name)


def _same_size_neighbours(header: dict) -> tuple[str, str]:
    order = _by_offset(header)
    size = lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]  # noqa: E731
    for a, b in itertools.pairwise(order):
        if size(a) == size(b):
            return a, b
    raise AssertionError("no neighbouring tensors of equal size")


def test_overlapping_data_offsets(st_copy):
    d, f = st_copy
    header, data = read_raw(f)
    a, b = _same_size_neighbours(header)
    s0, s1 = header[a]["data_offsets"]
    header[b]["data_offsets"] = [s0 + 4, s1 + 4]  # b now starts inside a
    _rewrite(f, header, data)
    msg = _expect(d, SafetensorsFormatError, f.name, b)
    assert "overlap" in msg


def test_holed_data_offsets(st_copy):
    d, f = st_copy
    header, data = read_raw(f)
    last = _by_offset(header)[-1]
    s0, s1 = header[last]["data_offsets"]
    header[last]["data_offsets"] = [s0 + 16, s1 + 16]
    _rewrite(f, header, data[:s0] + b"\0" * 16 + data[s0:])
    msg = _expect(d, SafetensorsFormatError, f.name, last)
    assert "hole" in msg


def test_trailing_bytes(st_copy):
    d, f = st_copy
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    _expect(d, SafetensorsFormatError, f.name)


@pytest.mark.parametrize("edit", ["dtype", "shape", "bytes"])
def test_dtype_shape_bytecount_mismatch(st_copy, edit):
    d, f = st_copy
    header, data = read_raw(f)
    name = "model.layers.1.mlp.down_proj.weight"  # F32 [64, 128]
    e = header[name]
    if edit == "dtype":
        e["dtype"] = "F16"
    elif edit == "shape":
        e["shape"] = [64, 127]
    else:
        e["data_offsets"][1] -= 4
    _rewrite(f, header, data)
    msg = _expect(d, SafetensorsFormatError, f.name, name)
    assert "mismatch" in msg or "bytes" in msg


def test_unknown_dtype(st_copy):
    d, f = st_copy
    header, data = read_raw(f)
    header["model.norm.weight"]["dtype"] = "F4_XYZ"
    _rewrite(f, header, data)
    _expect(d, SafetensorsFormatError, f.name, "model.norm.weight", "F4_XYZ")


def test_tensor_listed_twice_in_one_header(st_copy):
    """A duplicate JSON key in a header would otherwise be silently shadowed."""
    d, f = st_copy
    header, data = read_raw(f)
    name = _by_offset(header)[-1]
    text = json.dumps(header, separators=(",", ":"))
    dup = json.dumps({name: header[name]}, separators=(",", ":"))[1:-1]
    _rewrite(f, text[:-1] + "," + dup + "}", data)
    msg = _expect(d, SafetensorsFormatError, f.name, name)
    assert "twice" in msg or "duplicate" in msg


def test_zero_sized_tensors_are_fine(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(0, 4), "b": torch.arange(3.0), "c": torch.zeros(0)}, f)
    ck = open_checkpoint(tmp_path)
    assert ck.get("a").shape == (0, 4) and ck.get("c").shape == (0,)
    assert_bitwise(ck.get("b"), torch.arange(3.0))


# -- directory-level inconsistencies ---------------------------------------------------


def test_index_names_missing_file(tiny_models, tmp_path):
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=3)
    gone = "model-00002-of-00003.safetensors"
    (sh / gone).unlink()
    _expect(sh, CheckpointError, gone, "model.safetensors.index.json")


def test_index_lists_tensor_in_no_file(tiny_models, tmp_path):
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    idx = sh / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(j))
    _expect(sh, CheckpointError, "model.layers.9.mlp.up_proj.weight")


def test_index_puts_tensor_in_wrong_file(tiny_models, tmp_path):
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    idx = sh / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    name = next(k for k, v in j["weight_map"].items() if v.startswith("model-00001"))
    j["weight_map"][name] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(j))
    _expect(sh, CheckpointError, name)


def test_index_does_not_list_a_stored_tensor(tiny_models, tmp_path):
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    idx = sh / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    name = "model.layers.0.self_attn.k_proj.weight"
    del j["weight_map"][name]
    idx.write_text(json.dumps(j))
    _expect(sh, CheckpointError, name)


def test_tensor_listed_twice_in_two_files(tiny_models, tmp_path):
    d = tmp_path / "m"
    sh = reshard(tiny_models["llama"], d, n_files=2)
    (sh / "model.safetensors.index.json").unlink()
    f1, f2 = sorted(sh.glob("*.safetensors"))
    dup = "model.norm.weight"
    with safe_open(f1, "pt") as s1, safe_open(f2, "pt") as s2:
        k1, k2 = set(s1.keys()), set(s2.keys())
        assert dup in k2 and dup not in k1
        first = {k: s1.get_tensor(k) for k in k1}
        first[dup] = s2.get_tensor(dup)
    save_file(first, f1)
    _expect(sh, CheckpointError, dup, f1.name, f2.name)


def test_duplicate_key_in_index(tiny_models, tmp_path):
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    idx = sh / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    name, file = next(iter(j["weight_map"].items()))
    text = json.dumps(j)
    entry = json.dumps({name: file})[1:-1]
    text = text.replace('"weight_map": {', '"weight_map": {' + entry + ", ", 1)
    assert text.count(json.dumps(name)) == 2
    idx.write_text(text)
    _expect(sh, CheckpointError, name, idx.name)


def test_no_weights_at_all(tiny_models, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_bytes((tiny_models["llama"] / "config.json").read_bytes())
    _expect(d, CheckpointError, str(d))


def test_missing_path(tmp_path):
    _expect(tmp_path / "nope", CheckpointError, "nope")


def test_unknown_model_type(tiny_models, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["model_type"] = "gpt_nonexistent"
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(st_file(tiny_models["llama"]).read_bytes())
    ck = open_checkpoint(d)
    with pytest.raises(ArchError) as ei:
        A.resolve(ck.config)
    msg = str(ei.value)
    assert "gpt_nonexistent" in msg
    for known in A.known_model_types():
        assert known in msg


def test_unknown_tensor_names(tiny_models, tmp_path):
    src = tiny_models["deepseek_v3"]
    state = load_state(src)
    extra = {
        "model.layers.0.mlp.mystery_proj.weight": torch.zeros(4, 4),
        "model.layers.7.input_layernorm.weight": torch.zeros(64),  # only 3 layers
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(32, 64),  # dense layer
        "model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64),  # 8 experts
    }
    state.update(extra)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    save_file(state, d / "model.safetensors")
    ck = open_checkpoint(d)
    a, cfg = A.resolve(ck.config)
    with pytest.raises(UnknownTensorsError) as ei:
        a.classify(cfg, ck.names(), where=str(d))
    assert sorted(ei.value.names) == sorted(extra)
    assert isinstance(ei.value, ArchError)
    for n in extra:
        assert n in str(ei.value)
    assert str(d) in str(ei.value)


# -- torch .bin: the safe unpickler only -----------------------------------------------


class _Payload:
    """Unpickling this creates ``marker`` - stands in for arbitrary code execution."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bin_payload_really_executes_without_the_safe_unpickler(tmp_path):
    """Guard for the test below: the crafted file does run code under full unpickling."""
    marker = tmp_path / "pwned_control"
    f = tmp_path / "control.bin"
    torch.save({"w": torch.zeros(2), "x": _Payload(marker)}, f)
    torch.load(f, weights_only=False)
    assert marker.exists()


def test_bin_with_code_execution_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "m"
    d.mkdir()
    f = d / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2), "x": _Payload(marker)}, f)
    with pytest.raises(UnsafePickleError) as ei:
        open_checkpoint(d)
    assert f.name in str(ei.value)
    assert not marker.exists()


def test_raw_pickle_bin_is_refused_without_executing(tmp_path):
    """A legacy / non-zip pickle must not be unpickled either."""
    marker = tmp_path / "pwned_raw"
    d = tmp_path / "m"
    d.mkdir()
    f = d / "pytorch_model.bin"
    f.write_bytes(pickle.dumps({"x": _Payload(marker)}))
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(d)
    assert f.name in str(ei.value)
    assert not marker.exists()


def test_bin_that_is_not_a_state_dict(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    torch.save([torch.zeros(2)], d / "pytorch_model.bin")
    _expect(d, CheckpointError, "pytorch_model.bin")


def test_all_errors_are_k3errors():
    for e in (CheckpointError, SafetensorsFormatError, UnsafePickleError, ArchError):
        assert issubclass(e, K3Error) and e.exit_code == 2


def test_mtp_checkpoint_reads(tiny_models, tmp_path):
    d = append_mtp_layer(tiny_models["deepseek_v3"], tmp_path / "mtp")
    ck = open_checkpoint(d)
    ref = load_state(d)
    assert sorted(ck.names()) == sorted(ref)
    n = "model.layers.3.shared_head.head.weight"
    assert_bitwise(ck.get(n), ref[n])


# -- nothing outside the model directory is read (issue 12.2) --------------------------


def _index_dir(tiny_models, tmp_path) -> tuple[Path, Path, dict]:
    """A 2-file sharded llama in tmp/sh and a spare copy of its files in tmp/other."""
    sh = reshard(tiny_models["llama"], tmp_path / "sh", n_files=2)
    other = tmp_path / "other"
    other.mkdir()
    for f in sh.glob("*.safetensors"):
        (other / f.name).write_bytes(f.read_bytes())
    idx = sh / "model.safetensors.index.json"
    return sh, other, json.loads(idx.read_text())


def _first_tensor_of(j: dict, fname: str) -> str:
    return next(k for k, v in j["weight_map"].items() if v == fname)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_entry_outside_model_dir_is_refused(tiny_models, tmp_path, how):
    sh, other, j = _index_dir(tiny_models, tmp_path)
    fname = "model-00002-of-00002.safetensors"
    name = _first_tensor_of(j, fname)
    if how == "dotdot":
        target = f"../other/{fname}"
    elif how == "absolute":
        target = str(other / fname)
    else:
        (sh / "link.safetensors").symlink_to(other / fname)
        target = "link.safetensors"
    (sh / fname).unlink()  # only the copy outside exists
    for k, v in j["weight_map"].items():
        if v == fname:
            j["weight_map"][k] = target
    (sh / "model.safetensors.index.json").write_text(json.dumps(j))
    msg = _expect(sh, CheckpointError, "model.safetensors.index.json", target, "outside")
    assert f"'{name}'" in msg and "\n" not in msg


def test_index_entry_symlink_inside_model_dir_is_fine(tiny_models, tmp_path):
    """A link that stays inside the directory (e.g. into a blobs/ folder) is read."""
    sh, _, _ = _index_dir(tiny_models, tmp_path)
    fname = "model-00002-of-00002.safetensors"
    (sh / "blobs").mkdir()
    (sh / fname).rename(sh / "blobs" / "abc123")
    (sh / fname).symlink_to(Path("blobs") / "abc123")
    ck = open_checkpoint(sh)
    ref = load_state(tiny_models["llama"])
    for n in ck.names():
        assert_bitwise(ck.get(n), ref[n], n)


def test_hub_cache_snapshot_links_into_its_blobs_are_read(tiny_models, tmp_path):
    """huggingface_hub's cache: snapshots/REV/* are links to ../../blobs/SHA (the layout
    every `huggingface-cli download` without --local-dir leaves); a link to another
    model's blobs is still refused."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(tiny_models["llama"].iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    ck = open_checkpoint(snap)
    ref = load_state(tiny_models["llama"])
    for n in ck.names():
        assert_bitwise(ck.get(n), ref[n], n)
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (snap / "config.json").unlink()
    shutil.copyfile(tiny_models["llama"] / "config.json", other / "cfg")
    (snap / "config.json").symlink_to(other / "cfg")
    _expect(snap, CheckpointError, "config.json", "outside")


def test_safetensors_symlink_outside_model_dir_is_refused(st_copy, tmp_path):
    d, _ = st_copy
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"model.norm.weight": torch.ones(64)}, outside)
    (d / "extra.safetensors").symlink_to(outside)
    _expect(d, CheckpointError, "extra.safetensors", "outside", str(d))


@pytest.mark.parametrize("which", ["tokenizer.json", "config.json"])
def test_aux_or_config_symlink_outside_model_dir_is_refused(st_copy, tmp_path, which):
    """Aux files are carried into outputs: one that links outside would copy a foreign
    file (e.g. a secret) into the converted model."""
    d, _ = st_copy
    secret = tmp_path / "secret.json"
    secret.write_text((d / "config.json").read_text())
    (d / which).unlink(missing_ok=True)
    (d / which).symlink_to(secret)
    _expect(d, CheckpointError, which, "outside", str(d))


def test_index_outside_model_dir_is_refused_by_every_verb(tiny_models, tmp_path, capsys):
    """`shard` used to crash with a raw ValueError from Path.relative_to."""
    from k3convert.cli import main

    sh, other, j = _index_dir(tiny_models, tmp_path)
    for k in j["weight_map"]:
        j["weight_map"][k] = str(other / j["weight_map"][k])
    (sh / "model.safetensors.index.json").write_text(json.dumps(j))
    for argv in (["inspect", sh], ["shard", sh, tmp_path / "out"]):
        rc = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2 and "outside" in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out").exists()


# -- compressed-tensors weight_shape of the wrong kind (issue 12.13) -------------------


def _packed_dir(tmp_path: Path, weight_shape: torch.Tensor) -> Path:
    """A one-tensor llama-shaped pack-quantized int4 checkpoint with a given weight_shape."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tests.encode import int_group_quantize, pack_quantized_config

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = int_group_quantize(w, 4, 32)
    base = "model.layers.0.mlp.up_proj."
    d = tmp_path / "packed"
    d.mkdir()
    cfg = {"model_type": "llama", "quantization_config": pack_quantized_config(4, 32, True, [])}
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {
        base + "weight_packed": pack_to_int32(q["q"], 4),
        base + "weight_scale": q["scale"],
        base + "weight_shape": weight_shape,
    }
    save_file(tensors, d / "model.safetensors")
    return d


def test_packed_weight_shape_good_control(tmp_path):
    d = _packed_dir(tmp_path, torch.tensor([16, 64]))
    ck = open_checkpoint(d)
    assert ck.meta("model.layers.0.mlp.up_proj.weight").shape == (16, 64)
    assert ck.get("model.layers.0.mlp.up_proj.weight").shape == (16, 64)


@pytest.mark.parametrize(
    "ws",
    [
        torch.tensor([16, 64, 1]),  # rank 3 shape
        torch.tensor([[16, 64], [16, 64]]),  # 2-D
        torch.tensor(16),  # scalar
        torch.tensor([16.0, 64.0]),  # float dtype
        torch.tensor([True, True]),  # bool dtype
        torch.tensor([-16, 64]),  # negative
        torch.tensor([16, -64]),
        torch.tensor([2**40, 64]),  # huge
        torch.tensor([16, 2**62]),
        torch.tensor([8, 64]),  # disagrees with weight_packed's rows
        torch.tensor([], dtype=torch.int64),  # empty
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_packed_weight_shape_malformed_is_a_checkpoint_error(tmp_path, ws):
    d = _packed_dir(tmp_path, ws)
    msg = _expect(d, CheckpointError, "model.layers.0.mlp.up_proj.weight_shape")
    assert "model.safetensors" in msg and "\n" not in msg


# -- header JSON that is deep, or has bools / non-integers for integers (12.13, 12.17) --


def test_deeply_nested_header_is_a_format_error(st_copy):
    d, f = st_copy
    _, data = read_raw(f)
    deep = '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _rewrite(f, deep, data)
    msg = _expect(d, SafetensorsFormatError, f.name)
    assert "nested" in msg and "\n" not in msg


def test_deeply_nested_config_and_manifest_are_clean_errors(st_copy, tmp_path):
    from k3convert.stream import ManifestError, open_stream

    d, _ = st_copy
    (d / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _expect(d, CheckpointError, "config.json", "nested")
    s = tmp_path / "stream"
    s.mkdir()
    (s / "manifest.json").write_text('{"format": ' + "{" * 50_000)
    with pytest.raises(ManifestError, match="nested"):
        open_stream(s)


F32_64 = {"dtype": "F32", "shape": [64, 1], "data_offsets": [0, 256]}
U8_1 = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [
        (F32_64, "shape", [64, True]),
        (F32_64, "shape", [True, 64]),
        (F32_64, "shape", [64.0, 1]),
        (F32_64, "shape", [64, -1]),
        (F32_64, "shape", "64"),
        (U8_1, "shape", [True]),
        (U8_1, "data_offsets", [0, True]),
        (U8_1, "data_offsets", [False, 1]),
        (U8_1, "data_offsets", [0.0, 1]),
        (U8_1, "data_offsets", [0, 1.0]),
        (U8_1, "data_offsets", [0, 1, 1]),
        (U8_1, "dtype", ["U8"]),  # unhashable: used to raise TypeError
        (U8_1, "dtype", True),
    ],
)
def test_header_entry_non_integers_are_rejected(tmp_path, base, field, value):
    """JSON true is a Python int: [64, true] used to pass as [64, 1]."""
    d = tmp_path / "m"
    d.mkdir()
    entry = dict(base, **{field: value})
    write_raw(
        d / "model.safetensors", {"model.norm.weight": entry}, b"\0" * base["data_offsets"][1]
    )
    msg = _expect(d, SafetensorsFormatError, "model.safetensors", "model.norm.weight")
    assert "\n" not in msg


def test_stream_unit_header_uses_the_same_entry_parser():
    from k3convert.stream import StreamCorruptError
    from k3convert.stream.format import ALIGN, parse_header

    js = json.dumps({"t": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}).encode()
    head = struct.pack("<Q", ALIGN - 8) + js + b" " * (ALIGN - 8 - len(js))
    with pytest.raises(StreamCorruptError, match="invalid shape"):
        parse_header(head + b"\0", ALIGN + 1, "unit.safetensors")


def test_header_shape_too_large_for_torch_is_rejected(tmp_path):
    """A zero-element tensor whose other dims overflow int64 strides."""
    d = tmp_path / "m"
    d.mkdir()
    entry = {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}
    write_raw(d / "model.safetensors", {"model.norm.weight": entry}, b"")
    _expect(d, SafetensorsFormatError, "model.safetensors", "model.norm.weight")


def test_packed_weight_packed_of_the_wrong_kind_is_a_checkpoint_error(tmp_path):
    """A 1-D or float weight_packed used to raise IndexError / pass to the unpacker."""
    d = _packed_dir(tmp_path, torch.tensor([16, 64]))
    f = d / "model.safetensors"
    header, data = read_raw(f)
    name = "model.layers.0.mlp.up_proj.weight_packed"
    header[name]["shape"] = [math.prod(header[name]["shape"])]
    _rewrite(f, header, data)
    _expect(d, CheckpointError, name, "int32")
    header[name]["dtype"] = "F32"
    _rewrite(f, header, data)
    _expect(d, CheckpointError, name, "int32")


def test_packed_zero_point_of_the_wrong_rank_is_a_checkpoint_error(tmp_path):
    """A 3-D weight_zero_point used to crash the unpacker with a RuntimeError in get()."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tests.encode import int_group_quantize, pack_quantized_config

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = int_group_quantize(w, 4, 32, symmetric=False)
    base = "model.layers.0.mlp.up_proj."
    zp = pack_to_int32(q["zero_point"], 4, packed_dim=0)  # [2, 2]
    d = tmp_path / "m"
    d.mkdir()
    qc = pack_quantized_config(4, 32, False, [])
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    tensors = {
        base + "weight_packed": pack_to_int32(q["q"], 4),
        base + "weight_scale": q["scale"],
        base + "weight_shape": torch.tensor([16, 64]),
        base + "weight_zero_point": zp.reshape(1, *zp.shape),
    }
    save_file(tensors, d / "model.safetensors")
    ck = open_checkpoint(d)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*zero point"):
        ck.get(base + "weight")
    tensors[base + "weight_zero_point"] = zp
    save_file(tensors, d / "model.safetensors")
    assert open_checkpoint(d).get(base + "weight").shape == (16, 64)  # control


def test_empty_scale_without_a_block_is_a_checkpoint_error(tmp_path):
    """scale_block divided by a zero scale dim (ZeroDivisionError) when no block is known."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.zeros(4, 8).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale": torch.ones(0, 1),
    }
    save_file(tensors, d / "model.safetensors")
    _expect(d, CheckpointError, "model.layers.0.mlp.up_proj.weight", "empty")
