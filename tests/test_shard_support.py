"""Helpers for the shard / stream tests (no tests here).

- re-encode a transformers-written checkpoint as FP8-block or int4 pack-quantized
  (our own small encoders, following the public DeepSeek-V3 / compressed-tensors layouts);
- add DeepSeek-V3 MTP layers (transformers does not save them);
- an independent reassembly oracle that reads the units with the safetensors library
  and the manifest JSON only (no k3convert reader code).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
import zstandard
from safetensors.torch import load, load_file, save_file

from k3convert.arch import resolve
from k3convert.formats.intn import pack_int32
from k3convert.stream import read_manifest_doc
from tests.models import unit_hash

QUANT_COMPONENTS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _quantizable(src: Path, names) -> list[str]:
    cfg = json.loads((src / "config.json").read_text())
    arch, c = resolve(cfg)
    roles = arch.classify(c, names)
    return [n for n, r in roles.items() if r.component in QUANT_COMPONENTS and n.endswith("weight")]


def _copy(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    for f in dst.glob("*.index.json"):
        f.unlink()
    return source_tensors(src)


def fp8_block(src: Path, dst: Path, block=(8, 8)) -> Path:
    """DeepSeek-V3 FP8: e4m3 weight + float32 weight_scale_inv [ceil(out/b0), ceil(in/b1)]."""
    sd = _copy(src, dst)
    b0, b1 = block
    for n in _quantizable(src, list(sd)):
        w = sd.pop(n).float()
        out, inp = w.shape
        s0, s1 = math.ceil(out / b0), math.ceil(inp / b1)
        padded = torch.zeros(s0 * b0, s1 * b1)
        padded[:out, :inp] = w
        amax = padded.reshape(s0, b0, s1, b1).abs().amax(dim=(1, 3)).clamp(min=1e-8)
        scale = amax / 448.0
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:out, :inp]
        sd[n] = (w / full).to(torch.float8_e4m3fn)
        sd[n.removesuffix(".weight") + ".weight_scale_inv"] = scale.float()
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def int4_group(src: Path, dst: Path, group: int = 16) -> Path:
    """compressed-tensors pack-quantized int4, asymmetric, group-wise along the input dim."""
    sd = _copy(src, dst)
    for n in _quantizable(src, list(sd)):
        w = sd.pop(n).float()
        out, inp = w.shape
        g = w.reshape(out, inp // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zp = (torch.round(-lo / scale) - 8).clamp(-8, 7)
        q = (torch.round(g / scale[..., None]) + zp[..., None]).clamp(-8, 7).reshape(out, inp)
        base = n.removesuffix(".weight")
        sd[base + ".weight_packed"] = pack_int32(q.to(torch.int8), 4)
        sd[base + ".weight_scale"] = scale.to(torch.bfloat16)
        sd[base + ".weight_zero_point"] = pack_int32(zp.to(torch.int8), 4, packed_dim=0)
        sd[base + ".weight_shape"] = torch.tensor([out, inp], dtype=torch.int64)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": False,
                    "strategy": "group",
                    "group_size": group,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def add_mtp(src: Path, dst: Path, n: int = 1, seed: int = 1) -> Path:
    """A copy of a DeepSeek-V3 checkpoint with ``n`` MTP layers in a second file."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = n
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    arch, c = resolve(cfg)
    g = torch.Generator().manual_seed(seed)
    sd = {
        i.name: torch.randn(i.shape, generator=g) for i in arch.instances(c, mtp=True) if i.role.mtp
    }
    save_file(sd, dst / "model-mtp.safetensors", metadata={"format": "pt"})
    return dst


def unit_state(out: Path, u: dict) -> dict[str, torch.Tensor]:
    data = (out / u["file"]).read_bytes()
    if u["compression"] == "zstd":
        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=u["raw_bytes"])
    assert unit_hash(data) == u["raw_hash"]
    return load(data)


def reassemble(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(global tensors by physical name, tied copies by name) from all ranks' units."""
    man = read_manifest_doc(out)
    glob: dict[str, torch.Tensor] = {}
    cover: dict[str, torch.Tensor] = {}
    tied: dict[str, torch.Tensor] = {}
    for r in man["ranks"]:
        for u in r["units"]:
            sd = unit_state(out, u)
            assert sorted(k for k in sd if not k.startswith("__pad__.")) == sorted(
                e["name"] for e in u["tensors"]
            )
            for e in u["tensors"]:
                t = sd[e["name"]]
                assert list(t.shape) == e["shape"]
                if e["contents"] == "local_shape":
                    t = torch.tensor(e["logical_shape"], dtype=t.dtype)
                    e = {**e, "split_dim": None}
                target = tied if e["tied_to"] else glob
                name = e["name"]
                if name not in target:
                    target[name] = torch.zeros(e["global_shape"], dtype=t.dtype)
                    d = e["split_dim"]
                    cover[(id(target), name)] = torch.zeros(
                        e["global_shape"][d] if d is not None else 1, dtype=torch.int32
                    )
                g, c = target[name], cover[(id(target), name)]
                d = e["split_dim"]
                if d is None:
                    if c[0]:
                        assert _bytes_equal(g, t), f"replicas of {name} differ"
                    g.copy_(t)
                    c[0] += 1
                    continue
                real = e["shape"][d] - e["pad"]
                if e["pad"]:
                    padding = t.narrow(d, real, e["pad"])
                    assert not padding.view(torch.uint8).any(), f"{name}: padding not zero"
                dst = g.narrow(d, e["offset"], real)
                if bool((c[e["offset"] : e["offset"] + real] > 0).any()):
                    assert _bytes_equal(dst, t.narrow(d, 0, real)), f"replicas of {name} differ"
                dst.copy_(t.narrow(d, 0, real))
                c[e["offset"] : e["offset"] + real] += 1
    for key, c in cover.items():
        assert bool((c > 0).all()), f"{key[1]}: not every slice is covered"
    return glob, tied


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def assert_lossless(src: Path, out: Path) -> dict:
    """Every source tensor comes back bit for bit; tied heads equal the embedding."""
    source = source_tensors(src)
    glob, tied = reassemble(out)
    assert sorted(glob) == sorted(source)
    for n, t in source.items():
        assert _bytes_equal(glob[n], t), f"{n} differs after reassembly"
    for n, t in tied.items():
        man = read_manifest_doc(out)
        src_name = next(
            e["tied_to"]
            for r in man["ranks"]
            for u in r["units"]
            for e in u["tensors"]
            if e["name"] == n
        )
        assert _bytes_equal(t, source[src_name])
    return read_manifest_doc(out)


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
