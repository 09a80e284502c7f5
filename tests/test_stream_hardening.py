"""Stream checks that do not trust the manifest (issue 12: items 10, 11, 12 and 19).

Each damage is made the hard way: the manifest is edited (or a unit rewritten) and every
hash the manifest holds is brought up to date, so only the cross-checks can catch it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import zstandard

from k3convert.cli import main
from k3convert.errors import ConfigError
from k3convert.shard import check, shard
from k3convert.stream import (
    ManifestError,
    StreamCorruptError,
    StreamError,
    open_stream,
    read_manifest_doc,
    write_manifest_doc,
)
from k3convert.stream.format import dump_manifest
from tests.models import unit_hash
from tests.test_shard_support import fp8_block, int4_group


def make(src, out, **kw):
    kw.setdefault("progress", False)
    return shard(src=src, out=out, **kw).out


def _load(out: Path) -> dict:
    return read_manifest_doc(out)


def _save(out: Path, man: dict) -> None:
    write_manifest_doc(out, man)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _units(man):
    return [(r["rank"], u) for r in man["ranks"] for u in r["units"]]


def _rewrite(out: Path, u: dict, stored: bytes, raw: bytes | None = None) -> None:
    """Replace a unit's stored bytes and make the manifest's hash fields agree."""
    (out / u["file"]).write_bytes(stored)
    u.update(bytes=len(stored), hash=unit_hash(stored))
    if raw is not None:
        u.update(raw_bytes=len(raw), raw_hash=unit_hash(raw))
    elif u["compression"] == "none":
        u.update(raw_bytes=len(stored), raw_hash=unit_hash(stored))


def _damaged(out: Path, *needles: str) -> str:
    rep = check(out)
    assert rep.status == "damaged" and rep.exit_code == 1, rep
    text = "\n".join(rep.problems)
    for n in needles:
        assert n in text, text
    assert all("\n" not in p for p in rep.problems)
    return text


def _load_all(out: Path) -> None:
    st = open_stream(out)
    for r in range(st.world):
        for _ in st.rank(r).units():
            pass


@pytest.fixture(scope="module")
def fp8_src(model_factory, tmp_path_factory):
    return fp8_block(model_factory("deepseek_v3"), tmp_path_factory.mktemp("fp8") / "m")


@pytest.fixture(scope="module")
def streams(fp8_src, tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    return {
        "fp8": make(fp8_src, d / "fp8"),
        "fp8-zstd": make(fp8_src, d / "fp8z", compress="zstd"),
        "llama-tp2": make(tiny_models["llama"], d / "l2", tp=2),
        "llama-tp2-zstd": make(tiny_models["llama"], d / "l2z", tp=2, compress="zstd"),
    }


@pytest.fixture
def copy(streams, tmp_path):
    def get(which: str) -> tuple[Path, dict]:
        dst = tmp_path / which
        shutil.copytree(streams[which], dst)
        return dst, _load(dst)

    return get


def _fp8_entry(man, part="weight"):
    for rank, u in _units(man):
        for e in u["tensors"]:
            if e["encoding"] == "fp8-block" and e["part"] == part:
                return rank, u, e
    raise AssertionError("no fp8-block tensor")


# -- 10: the manifest's description of a unit is cross-checked ---------------------------
def test_edited_encoding_is_damage_for_check_loader_and_forward(copy, capsys):
    out, man = copy("fp8")
    rank, u, e = _fp8_entry(man)
    for x in u["tensors"]:
        if x["logical"] == e["logical"]:
            x["encoding"] = "float-quantized"  # schema-valid; needs weight_scale, not _inv
    _save(out, man)
    text = _damaged(out, e["logical"], "float-quantized", "weight_scale", f"rank {rank}")
    assert "unit '" + u["name"] + "'" in text
    with pytest.raises(StreamCorruptError, match="needs parts"):
        open_stream(out)
    assert main(["shard", "--check", str(out)]) == 1
    capsys.readouterr()
    assert main(["forward", str(out), "--ids", "1 2 3"]) == 1  # was KeyError: 'weight_scale'
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and e["logical"] in err


def _swap_first_two(u):
    u["tensors"][0], u["tensors"][1] = u["tensors"][1], u["tensors"][0]


def _set(field, value, pick=lambda e: e["part"] == "weight_scale_inv"):
    def edit(u):
        e = next(e for e in u["tensors"] if pick(e))
        e[field] = value(e) if callable(value) else value

    return edit


def _plain_to_fp8(u):
    e = next(e for e in u["tensors"] if e["encoding"] == "plain")
    e["encoding"] = "fp8-block"  # a norm: no weight_scale_inv, not an FP8 dtype
    e["quant"] = {"num_bits": 8, "block": [8, 8], "symmetric": None, "strategy": None, "type": None}


def _set_all(field, value):
    def edit(u):
        e0 = next(e for e in u["tensors"] if e["part"] == "weight_scale_inv")
        for e in u["tensors"]:
            if e["logical"] == e0["logical"]:
                e[field] = value(e)

    return edit


EDITS = {
    "order": (_swap_first_two, "data order"),
    "encoding-plain-to-fp8": (_plain_to_fp8, "fp8-block"),
    "part": (_set("part", "weight_scale"), "forbids"),
    "logical": (_set("logical", lambda e: e["logical"] + "x"), "encoding 'fp8-block' needs"),
    "block-one-part": (_set("quant", lambda e: {**e["quant"], "block": [4, 8]}), "on 'quant'"),
    "block": (_set_all("quant", lambda e: {**e["quant"], "block": [4, 8]}), "does not fit"),
    "split_dim": (_set("split_dim", 0), "split_dim"),
    "offset": (_set("offset", 1), "split_dim is null"),
    "global_shape": (_set("global_shape", lambda e: [x + 1 for x in e["shape"]]), "null"),
    "raw_bytes": (lambda u: u.update(raw_bytes=u["raw_bytes"] + 4096, bytes=u["bytes"]), "raw"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_manifest_entry_edits_with_valid_hashes_are_damage(copy, edit):
    out, man = copy("fp8")
    mutate, needle = EDITS[edit]
    _, u, _ = _fp8_entry(man, "weight_scale_inv")
    mutate(u)
    _save(out, man)
    _damaged(out, needle, u["name"])
    with pytest.raises(StreamCorruptError):
        _load_all(out)


def test_split_offsets_must_tile_across_ranks(copy):
    out, man = copy("llama-tp2")
    name = "model.layers.0.self_attn.q_proj.weight"
    (e1,) = [e for e in man["ranks"][1]["units"][1]["tensors"] if e["name"] == name]
    assert e1["split_dim"] == 0 and e1["offset"] > 0
    e1["offset"] = 0  # both ranks now claim the first half; nobody holds the second
    _save(out, man)
    _damaged(out, name, "cover 32 of 64")


def test_header_padding_must_be_zero(copy):
    out, man = copy("llama-tp2")
    for _, u in _units(man):
        data = bytearray((out / u["file"]).read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        pads = [v for k, v in json.loads(data[8 : 8 + n]).items() if k.startswith("__pad__.")]
        if pads:
            break
    pad = pads[0]
    data[8 + n + pad["data_offsets"][0]] = 1
    _rewrite(out, u, bytes(data))
    _save(out, man)
    _damaged(out, "padding", "non-zero")


# -- 11: zstd frames are never trusted ----------------------------------------------------
def _frame_with_content_size(frame: bytes, size: int) -> bytes:
    """The same frame with an 8-byte Frame_Content_Size field claiming ``size``."""
    fhd = frame[4]
    single, dict_flag, fcs_flag = (fhd >> 5) & 1, fhd & 3, fhd >> 6
    wd_len = 0 if single else 1
    pos = 5 + wd_len + (0, 1, 2, 4)[dict_flag]
    fcs_len = (1 if single else 0, 2, 4, 8)[fcs_flag]
    # single-segment frames have no window descriptor: give the forged one a sane window
    window = frame[5 : 5 + wd_len] if wd_len else bytes([(27 - 10) << 3])
    head = frame[:4] + bytes([(3 << 6) | (fhd & 0x1F)]) + window + frame[5 + wd_len : pos]
    return head + size.to_bytes(8, "little") + frame[pos + fcs_len :]


@pytest.mark.parametrize("raw_too", [False, True])
def test_zstd_frame_claiming_a_terabyte_is_damage_without_allocating_it(copy, raw_too):
    out, man = copy("fp8-zstd")
    rank, u = max(_units(man), key=lambda ru: ru[1]["raw_bytes"])
    forged = _frame_with_content_size((out / u["file"]).read_bytes(), 2**40)
    assert zstandard.get_frame_parameters(forged).content_size == 2**40
    _rewrite(out, u, forged)
    if raw_too:  # the manifest agrees with the frame: bounded by the tensor table
        u["raw_bytes"] = 2**40
    _save(out, man)
    text = _damaged(out, u["file"], f"rank {rank}")
    assert ("claims 1099511627776" in text) or ("raw_bytes 1099511627776" in text)
    with pytest.raises(StreamCorruptError):
        _load_all(out)
    assert main(["shard", "--check", str(out)]) == 1


# -- 12: one zstd frame; replicated parts have split_dim null -----------------------------
EMPTY_FRAME = bytes.fromhex("28b52ffd240001000099e9d851")  # what the old writer appended


def test_writer_writes_exactly_one_zstd_frame(streams):
    out = streams["llama-tp2-zstd"]
    for _, u in _units(_load(out)):
        data = (out / u["file"]).read_bytes()
        d = zstandard.ZstdDecompressor().decompressobj()
        raw = d.decompress(data)
        assert d.eof and d.unused_data == b"", u["file"]  # nothing after the first frame
        assert len(raw) == u["raw_bytes"]
        p = zstandard.get_frame_parameters(data)
        assert p.content_size == u["raw_bytes"] and p.has_checksum


@pytest.mark.parametrize(
    "tail",
    [EMPTY_FRAME, b"\x00"],
    ids=["frame", "byte"],
)
def test_check_refuses_a_second_frame_or_trailing_bytes(copy, tail):
    out, man = copy("llama-tp2-zstd")
    rank, u = _units(man)[1]
    _rewrite(out, u, (out / u["file"]).read_bytes() + tail)
    _save(out, man)
    _damaged(out, "follow the zstd frame", u["file"])
    with pytest.raises(StreamCorruptError, match="exactly one frame"):
        list(open_stream(out).rank(rank).units())


def test_single_kv_head_held_whole_has_null_split_dim(model_factory, tmp_path):
    src = model_factory("llama", num_key_value_heads=1)  # MQA: every rank holds k/v whole
    out = make(src, tmp_path / "o", tp=2)
    man = _load(out)
    kv = [e for _, u in _units(man) for e in u["tensors"] if e["kind"] in ("k_proj", "v_proj")]
    assert kv and len(kv) % 4 == 0  # k and v, on 2 ranks, for every layer
    for e in kv:
        assert e["split_dim"] is None and e["offset"] == 0 and e["pad"] == 0, e
        assert e["shape"] == e["global_shape"]
    assert check(out).ok


def test_whole_part_recorded_as_split_is_damage(copy):
    out, man = copy("llama-tp2")
    _, u = _units(man)[1]
    e = next(e for e in u["tensors"] if e["split_dim"] is None)
    e["split_dim"] = 0  # as the old writer recorded a single KV head held whole
    _save(out, man)
    _damaged(out, "split_dim null", e["name"])


# -- 19: NaN counts, NaN manifests, paths outside the stream ----------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -3.0])
def test_expert_load_must_be_finite_and_non_negative(model_factory, tmp_path, bad, capsys):
    src = model_factory("qwen3_moe")  # 2 MoE layers of 8 experts
    f = tmp_path / "load.json"
    load = {"0": [5.0] * 8, "1": [5.0] * 8}
    load["1"][6] = bad
    f.write_text(json.dumps(load))  # NaN / Infinity written bare, as json.dumps does
    with pytest.raises(ConfigError, match=r"load\.json: layer 1, expert 6") as ei:
        shard(src=src, out=tmp_path / "o", tp=2, ep=2, expert_load=f, progress=False)
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "o" / "manifest.json").exists()
    argv = ["shard", str(src), str(tmp_path / "o2"), "--tp", "2", "--ep", "2"]
    assert main([*argv, "--expert-load", str(f)]) == 2
    assert "layer 1, expert 6" in capsys.readouterr().err


def test_manifest_writer_refuses_nan():
    with pytest.raises(ValueError):
        dump_manifest({"load": [1.0, math.nan]})
    assert dump_manifest({"load": [1.5]}) == json.dumps({"load": [1.5]}, indent=1) + "\n"


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_manifest_loader_refuses_nan_and_infinity(copy, token):
    out, man = copy("llama-tp2")
    man["source"]["recipe"] = {"alpha": "@"}  # recipe: any object (schema)
    _save(out, man)
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text.replace('"@"', token))
    with pytest.raises(ManifestError, match=r"not JSON|out of range"):
        open_stream(out)
    assert check(out).exit_code == 1


@pytest.fixture
def opened(monkeypatch):
    """Paths check() hashes carried files from."""
    seen: list[str] = []
    check_mod = importlib.import_module("k3convert.stream.check")
    real = check_mod.hashlib.file_digest

    def spy(fh, *a, **k):
        seen.append(os.path.realpath(fh.name))
        return real(fh, *a, **k)

    monkeypatch.setattr(check_mod.hashlib, "file_digest", spy)
    return seen


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_carried_file_outside_the_stream_is_refused_unopened(copy, tmp_path, opened, how):
    out, man = copy("llama-tp2")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    name = {"absolute": str(secret), "dotdot": f"../{secret.name}", "symlink": "link.txt"}[how]
    if how == "symlink":
        (out / "link.txt").symlink_to(secret)
    man["files"].append({"name": name, "bytes": 9, "sha256": _sha(secret.read_bytes())})
    _save(out, man)
    rep = check(out)
    assert rep.exit_code == 1, rep
    assert name in "\n".join(rep.problems)
    assert str(secret.resolve()) not in opened
    if how != "symlink":
        with pytest.raises(ManifestError, match=r"files\[\d+\]\.name"):
            open_stream(out)
    else:
        with pytest.raises(StreamCorruptError, match="outside the stream directory"):
            _ = open_stream(out).aux_files


def test_rank_directory_symlinked_outside_is_refused(copy, tmp_path):
    out, _ = copy("llama-tp2")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "rank00001", elsewhere)
    (out / "rank00001").symlink_to(elsewhere, target_is_directory=True)
    _damaged(out, "outside the stream directory", "rank 1")
    with pytest.raises(StreamCorruptError, match="outside the stream directory"):
        open_stream(out)


@pytest.mark.parametrize("name", ["rank00000/0000-x.safetensors", "rank00000/0000-..safetensors"])
def test_unit_file_must_have_its_format_name(copy, name):
    out, man = copy("llama-tp2")
    u = man["ranks"][0]["units"][0]
    (out / u["file"]).rename(out / name)
    u["file"] = name
    _save(out, man)
    with pytest.raises(ManifestError, match="not the format's name"):
        open_stream(out)
    assert check(out).exit_code == 1


def test_unknown_unit_is_a_stream_error(streams):
    rk = open_stream(streams["llama-tp2"]).rank(0)
    with pytest.raises(StreamError, match=r"no unit 'layer\.9'"):
        rk.unit("layer.9")
    with pytest.raises(StreamError, match="no unit 7"):
        rk.unit(7)


# -- what the stream reader raises is a StreamError ---------------------------------------
def _header_mutations():
    yield "deep", lambda h: b"[" * 50_000 + b"]" * 50_000
    yield "dtype-list", lambda h: h.replace(b'"dtype":"F32"', b'"dtype":["F32"]', 1)
    yield "offsets-float", lambda h: h.replace(b'"data_offsets":[0,', b'"data_offsets":[0.0,', 1)
    yield "not-utf8", lambda h: b"\xff" + h[1:]


MUTATIONS = dict(_header_mutations())


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_garbled_header_with_valid_hashes_is_a_stream_error(copy, name, compress):
    mutate = MUTATIONS[name]
    out, man = copy("llama-tp2" if compress == "none" else "llama-tp2-zstd")
    rank, u = _units(man)[1]
    f = out / u["file"]
    raw = f.read_bytes()
    if compress == "zstd":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    (n,) = struct.unpack("<Q", raw[:8])
    js = mutate(raw[8 : 8 + n].rstrip(b" "))
    region = -(-(8 + len(js)) // 4096) * 4096
    new = struct.pack("<Q", region - 8) + js + b" " * (region - 8 - len(js)) + raw[8 + n :]
    stored = new
    if compress == "zstd":
        c = zstandard.ZstdCompressor(write_checksum=True)
        stored = c.compress(new)
    _rewrite(out, u, stored, new)
    _save(out, man)
    try:
        list(open_stream(out).rank(rank).units())
    except StreamError as e:
        assert "\n" not in str(e)
    else:
        raise AssertionError("a garbled header was accepted")
    assert check(out).exit_code == 1


# -- no false alarms: what the writer makes, the checker accepts ---------------------------
LAYOUTS = [
    ("llama", {}, dict(tp=4)),  # KV heads replicated
    ("llama", {"num_attention_heads": 8, "vocab_size": 157}, dict(tp=8, pp=3)),  # padding
    ("qwen3", {}, dict(tp=2, pp=3, compress="zstd")),  # tied embeddings, pp > layers
    ("qwen3_moe", {}, dict(tp=4, ep=2)),
    ("deepseek_v3", {}, dict(tp=4, pp=3, ep=4, compress="zstd")),
    ("deepseek_v3", {"q_lora_rank": None, "tie_word_embeddings": True}, dict(tp=2, ep=2)),
    ("kimi_k25", {}, dict(tp=2, pp=2, ep=2)),
    ("fp8", {}, dict(tp=2, ep=2)),
    ("int4", {}, dict(tp=2, compress="zstd")),
]


@pytest.mark.parametrize(
    "family,kw,lay", LAYOUTS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(LAYOUTS)]
)
def test_every_written_layout_checks_intact(model_factory, fp8_src, tmp_path, family, kw, lay):
    if family == "fp8":
        src = fp8_src
    elif family == "int4":
        src = int4_group(model_factory("llama"), tmp_path / "int4")
    else:
        src = model_factory(family, **kw)
    out = make(src, tmp_path / "o", **lay)
    rep = check(out)
    assert rep.ok, rep
    _load_all(out)


def test_a_header_changed_between_two_reads_is_parsed_again(copy):
    """A unit read twice in one process (``verify``: check, forward, decode) is parsed
    once only while its header bytes stay the same: a header rewritten in place between
    the reads, same length, is read anew and refused, and the original read back is
    accepted again."""
    from k3convert.stream.unit_loader import load_unit

    out, man = copy("llama-tp2")
    rank, u = next((r, u) for r, u in _units(man) if len(u["tensors"]) > 1)
    first = load_unit(out, rank, u, verify=False)
    assert set(first.tensors) == {e["name"] for e in u["tensors"]}
    path = out / u["file"]
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + n])
    a, b = (e["name"] for e in u["tensors"][:2])
    head[a], head[b] = head[b], head[a]  # two names swapped: same bytes, other offsets
    new = json.dumps(head, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n and new != data[8 : 8 + n]
    path.write_bytes(data[:8] + new + data[8 + n :])
    with pytest.raises(StreamCorruptError, match="header disagrees"):
        load_unit(out, rank, u, verify=False)
    path.write_bytes(data)
    assert set(load_unit(out, rank, u, verify=False).tensors) == set(first.tensors)
