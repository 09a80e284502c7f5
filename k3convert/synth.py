"""``k3convert synth``: a random checkpoint with a real architecture's exact layout.

Day-0 pre-adaptation: before the weights of a new release arrive, a team can write a
scaled-down checkpoint with the same tensor names, dtypes, encodings (FP8 blocks, packed
int4) and file layout, and rehearse the whole pipeline on it. The tensors come from
the architecture table (the same one ``inspect`` and every stage use), are generated
one at a time from a per-name seed (so the output does not depend on write order or
sharding) and are streamed to disk; memory stays at one tensor.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .arch import load_config, resolve
from .arch.base import Instance
from .checkpoint.output import group_by_size, shard_names, staged_output, write_index
from .checkpoint.safetensors_io import SafetensorsWriter
from .errors import ConfigError
from .formats import FP8_MAX
from .formats.dtypes import SHORT_DTYPES, SHORT_NAMES
from .formats.intn import pack_int32
from .quant.schemes import get_scheme
from .synth_tokenizer import check_special_ids, write_tokenizer
from .units import byte_bar

PRESETS = (
    "kimi-k2",
    "kimi-k2-thinking",
    "kimi-k25",
    "kimi-k3",
    "kimi-linear-48b",
    "deepseek-v3",
    "llama3-8b",
    "qwen3-30b-a3b",
)
#: --dtype choices, in the order the help lists them
DTYPES = {k: SHORT_DTYPES[k] for k in ("bf16", "fp16", "fp32")}
QUANTIZABLE = ("attention", "dense_mlp", "shared_experts", "routed_experts")
MXFP4_GROUP = 32
#: Kimi K3's released quantization_config (routed experts only; it sits in text_config)
MXFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": MXFP4_GROUP,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["re:.*lm_head", "re:vision_tower.*", "re:mm_projector.*", "re:.*self_attn.*"],
}


def preset_config(name: str) -> dict:
    """The bundled config.json of a preset (published dimensions of the release)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}.")
    text = resources.files("k3convert.presets").joinpath(f"{name}.json").read_text()
    cfg = json.loads(text)
    base = cfg.pop("_extends", None)
    if base:  # a preset may extend another: {".": "kimi-k2"} or {"text_config": "kimi-k2"}
        for key, ref in base.items():
            if key == ".":
                cfg = {**preset_config(ref), **cfg}
            else:
                cfg[key] = {**preset_config(ref), **cfg.get(key, {})}
    return cfg


def source_config(config: str) -> dict:
    p = Path(config)
    if p.exists():
        return load_config(p)
    if config in PRESETS:
        return preset_config(config)
    raise ConfigError(
        f"'{config}' is neither a config.json / model directory nor a preset "
        f"({', '.join(PRESETS)})."
    )


# -- scaling ------------------------------------------------------------------------
def text_section(raw: dict) -> dict:
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def _set_experts(t: dict, n: int) -> None:
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        if k in t:
            t[k] = n
    for k in ("num_experts_per_tok", "num_experts_per_token"):
        topk = t.get(k)
        if topk and topk > n:
            t[k] = max(1, min(topk, n))
    ng = t.get("n_group")
    if ng and n % ng:
        t["n_group"] = math.gcd(ng, n)
        t["topk_group"] = min(t.get("topk_group") or 1, t["n_group"])


#: the width every block (fp8-block 128x128) and group scheme (w4a16's g128) divides: a
#: tiny model's Linear inputs are multiples of it, so every preset scheme accepts it
TINY_WIDTH = 128
#: a tiny vocabulary holds the synthetic tokenizer's 256 bytes and its special tokens
TINY_VOCAB = 512


def tiny_overrides(raw: dict) -> dict:
    """Small dimensions that keep every structural feature of the config.

    Every Linear's input width is a multiple of :data:`TINY_WIDTH` (hidden 128, MLPs 256,
    MLA ranks 128 and 4 heads x 64, KDA 4 heads x 128, vision 128), so fp8-block and g128
    schemes apply as on the release, and the tensors tensor parallelism splits still
    split into whole 128-blocks at tp 2 (a block scheme at tp 4 would need 512-wide
    layers); a latent MoE's hidden size is twice its latent width (256) so that the two
    never coincide."""
    t = text_section(raw)
    mla = "kv_lora_rank" in t
    experts = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts")
    dense_first = t.get("first_k_dense_replace") or 0
    latent = bool(t.get("routed_expert_hidden_size"))
    o: dict[str, Any] = {
        "layers": min(t.get("num_hidden_layers", 2), max(2, dense_first + 2)),
        "hidden": 2 * TINY_WIDTH if latent else TINY_WIDTH,
        "heads": 4,
        "kv_heads": 4 if mla else min(t.get("num_key_value_heads") or 4, 2),
        "intermediate": 2 * TINY_WIDTH,
        "vocab": TINY_VOCAB,
    }
    if _hybrid(t):  # KDA + MLA: enough layers for both kinds, a dense one and 2 residual blocks
        o["layers"] = min(t.get("num_hidden_layers", 5), 5)
    if experts:
        o["experts"] = 8
        o["topk"] = min(t.get("num_experts_per_tok") or t.get("num_experts_per_token") or 2, 2)
        o["moe_intermediate"] = 2 * TINY_WIDTH  # a single shared expert splits at tp 2
    if t.get("num_nextn_predict_layers"):
        o["mtp"] = 1
    if isinstance(raw.get("vision_config"), dict):
        o["vision_layers"] = 2
    return o


def apply_overrides(raw: dict, o: dict, tiny: bool) -> dict:
    """A copy of ``raw`` with the given dimensions changed, consistently."""
    cfg = copy.deepcopy(raw)
    t = text_section(cfg)
    mla = "kv_lora_rank" in t
    if o.get("layers"):
        t["num_hidden_layers"] = o["layers"]
        if (t.get("first_k_dense_replace") or 0) >= o["layers"]:
            t["first_k_dense_replace"] = max(0, o["layers"] - 1)
        if t.get("mlp_only_layers"):
            t["mlp_only_layers"] = [i for i in t["mlp_only_layers"] if i < o["layers"]]
    if o.get("hidden"):
        t["hidden_size"] = o["hidden"]
    if o.get("heads"):
        t["num_attention_heads"] = o["heads"]
        if mla:
            t["num_key_value_heads"] = o["heads"]
    if o.get("kv_heads") and not mla:
        t["num_key_value_heads"] = o["kv_heads"]
    if (o.get("hidden") or o.get("heads")) and "head_dim" in t and not mla:
        t["head_dim"] = t["hidden_size"] // t["num_attention_heads"]
    if o.get("intermediate"):
        t["intermediate_size"] = o["intermediate"]
    if o.get("experts"):
        _set_experts(t, o["experts"])
    if o.get("topk"):
        t["num_experts_per_token" if "num_experts_per_token" in t else "num_experts_per_tok"] = o[
            "topk"
        ]
    if o.get("moe_intermediate"):
        t["moe_intermediate_size"] = o["moe_intermediate"]
    if o.get("vocab"):
        t["vocab_size"] = o["vocab"]
    if o.get("mtp") is not None and "num_nextn_predict_layers" in t:
        t["num_nextn_predict_layers"] = o["mtp"]
    if tiny and mla:
        # 4 heads x 64: o_proj's input and q_b / kv_b's outputs split in 128s at tp 2
        t.update(
            kv_lora_rank=TINY_WIDTH,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            q_lora_rank=TINY_WIDTH if t.get("q_lora_rank") else None,
        )
        if t.get("n_group", 1) > 1:
            t["n_group"], t["topk_group"] = 2, 1
        t["head_dim"] = 64
        t["qk_head_dim"] = 128
    if _hybrid(t):
        _scale_hybrid(t, o, tiny)
    v = cfg.get("vision_config")
    if isinstance(v, dict) and "vt_hidden_size" in v:  # Kimi K3's MoonViT3d
        if tiny:
            v.update(vt_hidden_size=TINY_WIDTH, vt_num_attention_heads=2)
            v.update(qkv_hidden_size=TINY_WIDTH, vt_intermediate_size=2 * TINY_WIDTH)
            v.update(init_pos_emb_height=8, init_pos_emb_width=8, mm_hidden_size=TINY_WIDTH)
        if o.get("vision_layers"):
            v["vt_num_hidden_layers"] = o["vision_layers"]
        if "text_hidden_size" in v:
            v["text_hidden_size"] = t["hidden_size"]
    elif isinstance(v, dict):
        if tiny:
            v.update(hidden_size=TINY_WIDTH, num_attention_heads=2)
            v.update(intermediate_size=2 * TINY_WIDTH, pos_emb_height=8, pos_emb_width=8)
            cfg["projection_hidden_size"] = TINY_WIDTH
        if o.get("vision_layers"):
            v["num_hidden_layers"] = o["vision_layers"]
    _fix_token_ids(cfg, t)
    if isinstance(v, dict) and "media_placeholder_token_id" in cfg:
        v["media_placeholder_token_id"] = cfg["media_placeholder_token_id"]
    return cfg


def _hybrid(t: dict) -> bool:
    """A KDA + MLA hybrid (kimi_linear, Kimi K3's text)."""
    return isinstance(t.get("linear_attn_config"), dict)


def _scale_hybrid(t: dict, o: dict, tiny: bool) -> None:
    """Layer lists and KDA / latent-MoE widths of a hybrid after a change of depth."""
    lac = t["linear_attn_config"]
    n = t["num_hidden_layers"]
    if o.get("layers"):
        # the releases' pattern: every 4th layer and the last one are full attention
        full = sorted({i for i in range(4, n + 1, 4)} | {n})
        lac["full_attn_layers"] = full
        lac["kda_layers"] = [i for i in range(1, n + 1) if i not in full]
        for key in ("layer_types", "mlp_layer_types"):
            t.pop(key, None)  # derived from the lists above and first_k_dense_replace
        block = t.get("attn_res_block_size")
        if block and tiny:
            t["attn_res_block_size"] = 2
        elif block and block >= n:
            t["attn_res_block_size"] = max(1, n // 2)
    if tiny:  # head_dim is the full-rank gate's rank (f_b_proj's input): 128 as released
        lac.update(num_heads=4, head_dim=TINY_WIDTH)
        if t.get("routed_expert_hidden_size"):
            t["routed_expert_hidden_size"] = TINY_WIDTH
    if o.get("latent"):  # the latent MoE's width (the routed experts' input)
        if not t.get("routed_expert_hidden_size"):
            raise ConfigError("--latent sets a latent MoE's width; this model has no latent MoE.")
        t["routed_expert_hidden_size"] = o["latent"]
    if o.get("heads"):  # KDA heads follow the attention heads (tiny or not)
        lac["num_heads"] = o["heads"]
    for k in ("linear_num_heads", "linear_head_dim"):
        t.pop(k, None)


def _fix_token_ids(cfg: dict, t: dict) -> None:
    """Special token ids must stay inside a shrunken vocabulary."""
    vocab = t["vocab_size"]
    special = [
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "media_placeholder_token_id",
    ]
    for i, k in enumerate(special):
        if k in cfg and cfg[k] is not None and cfg[k] >= vocab:
            cfg[k] = vocab - len(special) + i
    for d in (cfg, t):
        for k, default in (("bos_token_id", 0), ("eos_token_id", 1), ("pad_token_id", None)):
            if isinstance(d.get(k), int) and d[k] >= vocab:
                d[k] = default


# -- encodings ----------------------------------------------------------------------
def _ignored(module: str, ignore: list[str]) -> bool:
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif pat == module:
            return True
    return False


ENCODINGS = ("auto", "plain", "fp8-block", "int4", "mxfp4")


def encoding_for(inst: Instance, raw: dict, choice: str) -> str:
    """'plain', 'fp8-block', 'int4' or 'mxfp4' for one tensor under the --encoding choice.

    mxfp4 (Kimi K3's release) applies to routed experts only, as in the release."""
    role = inst.role
    linear = (
        len(inst.shape) == 2
        and inst.name.endswith(".weight")
        and not role.keep
        and role.component in QUANTIZABLE
    )
    if not linear or choice == "plain":
        return "plain"
    if choice == "mxfp4":
        return "mxfp4" if role.component == "routed_experts" else "plain"
    if choice in ("fp8-block", "int4"):
        return choice
    qc = raw.get("quantization_config") or text_section(raw).get("quantization_config") or {}
    if qc.get("format") == "mxfp4-pack-quantized":
        return "mxfp4" if role.component == "routed_experts" else "plain"
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8-block"
    if method == "compressed-tensors":
        module = inst.name.removesuffix(".weight")
        return "plain" if _ignored(module, qc.get("ignore") or []) else "int4"
    return "plain"


def int4_params(raw: dict) -> tuple[int, bool]:
    """(group_size, symmetric) of the config's int4 group, defaults (32, True)."""
    qc = raw.get("quantization_config") or {}
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("num_bits") == 4:
            return int(w.get("group_size") or 32), bool(w.get("symmetric", True))
    return 32, True


def fp8_block_encode(w: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    """w: [out, in] -> weight e4m3 [out, in], weight_scale_inv fp32 [ceil(out/b0), ceil(in/b1)]."""
    out, inp = w.shape
    b0, b1 = block
    r, c = math.ceil(out / b0), math.ceil(inp / b1)
    padded = torch.zeros(r * b0, c * b1, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.reshape(r, b0, c, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(r * b0, c * b1)[:out, :inp].to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}


def int4_encode(
    w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """w: [out, in] -> weight_packed int32 [out, in/8], weight_scale [out, in/group],
    weight_shape int64 [2] (+ weight_zero_point int32 [ceil(out/8), in/group])."""
    out, inp = w.shape
    if inp % group:
        raise ConfigError(
            f"int4 group size {group} does not divide input dim {inp}; pick --hidden / "
            f"--moe-intermediate as multiples of {group}."
        )
    g = w.float().reshape(out, inp // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8)
        scale = scale.to(scale_dtype).float()
        q = torch.round(g / scale[..., None]).clamp(-8, 7)
        zp = None
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
        zp = torch.round(-8 - lo / scale).clamp(-8, 7)
        q = torch.round(g / scale[..., None] + zp[..., None]).clamp(-8, 7)
    parts = {
        "weight_packed": pack_int32(q.reshape(out, inp).to(torch.int8), 4),
        "weight_scale": scale.to(scale_dtype),
        "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }
    if zp is not None:
        parts["weight_zero_point"] = pack_int32(zp.to(torch.int8), 4, packed_dim=0)
    return parts


# -- generation ---------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))


def random_tensor(inst: Instance, seed: int) -> torch.Tensor:
    """Values a forward pass can run on: N(0, 0.02) weights, ~1 norms, small biases."""
    g = _generator(seed, inst.name)
    x = torch.randn(inst.stored_shape, generator=g, dtype=torch.float32)
    kind = inst.role.kind
    if (
        inst.role.component == "norms"
        or kind
        in (
            "norm0",
            "norm1",
            "final_layernorm",
            "pre_norm",
            "mtp_enorm",
            "mtp_hnorm",
            "mtp_head_norm",
            "post_norm",
        )
        or kind.endswith("_res_norm")
        or kind == "routed_expert_norm"
    ):
        return 1.0 + 0.05 * x if inst.name.endswith("weight") else 0.02 * x
    if kind == "e_score_correction_bias":
        return 0.1 * x
    return 0.02 * x


@dataclass(frozen=True)
class _Planned:
    inst: Instance
    encoding: str
    parts: list[tuple[str, torch.dtype, tuple[int, ...]]]  # physical (name, dtype, shape)
    nbytes: int


def plan_instance(inst: Instance, enc: str, dtype: torch.dtype, raw: dict) -> _Planned:
    out_in = inst.stored_shape
    base = inst.name.removesuffix(".weight")
    if enc == "fp8-block":
        r, c = math.ceil(out_in[0] / 128), math.ceil(out_in[1] / 128)
        parts = [
            (inst.name, torch.float8_e4m3fn, out_in),
            (f"{base}.weight_scale_inv", torch.float32, (r, c)),
        ]
    elif enc == "int4":
        group, sym = int4_params(raw)
        if out_in[1] % group:
            raise ConfigError(
                f"tensor '{inst.name}' input dim {out_in[1]} is not a multiple of the int4 "
                f"group size {group}; choose dimensions that are multiples of {group}."
            )
        ng = out_in[1] // group
        parts = [
            (f"{base}.weight_packed", torch.int32, (out_in[0], math.ceil(out_in[1] * 4 / 32))),
            (f"{base}.weight_scale", dtype, (out_in[0], ng)),
            (f"{base}.weight_shape", torch.int64, (2,)),
        ]
        if not sym:
            parts.append((f"{base}.weight_zero_point", torch.int32, (math.ceil(out_in[0] / 8), ng)))
    elif enc == "mxfp4":
        if out_in[1] % MXFP4_GROUP:
            raise ConfigError(
                f"tensor '{inst.name}' input dim {out_in[1]} is not a multiple of the MXFP4 "
                f"group size {MXFP4_GROUP}; choose dimensions that are multiples of it."
            )
        parts = [
            (f"{base}.weight_packed", torch.uint8, (out_in[0], out_in[1] // 2)),
            (f"{base}.weight_scale", torch.uint8, (out_in[0], out_in[1] // MXFP4_GROUP)),
        ]
    else:
        parts = [(inst.name, dtype, out_in)]
    nbytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s in parts)
    return _Planned(inst, enc, parts, nbytes)


def _encode(p: _Planned, dtype: torch.dtype, raw: dict, seed: int) -> dict[str, torch.Tensor]:
    w = random_tensor(p.inst, seed)
    base = p.inst.name.removesuffix(".weight")
    if p.encoding == "fp8-block":
        e = fp8_block_encode(w)
    elif p.encoding == "int4":
        group, sym = int4_params(raw)
        e = int4_encode(w, group, sym, dtype)
    elif p.encoding == "mxfp4":  # the same quantizer `quantize --scheme mxfp4` uses
        e = get_scheme("mxfp4").quantize(w.to(dtype), name=p.inst.name)
    else:
        return {p.inst.name: w.to(dtype)}
    return {(p.inst.name if k == "weight" else f"{base}.{k}"): v for k, v in e.items()}


def output_config(raw: dict, encoding: str, dtype_name: str) -> dict:
    cfg = copy.deepcopy(raw)
    torch_name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype_name]
    for d in (cfg, text_section(cfg)):
        d["dtype"] = torch_name
        d.pop("torch_dtype", None)
    if encoding == "plain":
        cfg.pop("quantization_config", None)
        text_section(cfg).pop("quantization_config", None)
    elif encoding == "mxfp4":
        t = text_section(cfg)
        qc = t.get("quantization_config") or cfg.get("quantization_config") or {}
        if qc.get("format") != "mxfp4-pack-quantized":
            qc = copy.deepcopy(MXFP4_CONFIG)
        cfg.pop("quantization_config", None)  # the release keeps it inside text_config
        t["quantization_config"] = qc
    elif encoding == "fp8-block":
        text_section(cfg).pop("quantization_config", None)  # K3 keeps its (MXFP4) one there
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    elif (
        encoding == "int4"
        and (cfg.get("quantization_config") or {}).get("quant_method") != "compressed-tensors"
    ):
        text_section(cfg).pop("quantization_config", None)
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                        "dynamic": False,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head"],
        }
    return cfg


#: the Kimi K3 release's preprocessor_config.json, cut to what vLLM's image processor reads
#: (its sizes are replaced by the synthesized vision config's: :func:`preprocessor_config`)
K3_PREPROCESSOR = {
    "image_processor_type": "KimiK25FusedVisionProcessor",
    "media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
                       "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
                       "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}  # fmt: skip


def preprocessor_config(cfg: dict) -> dict | None:
    """The ``preprocessor_config.json`` a Kimi K3 (MoonViT3d) checkpoint carries: the
    release's, with the sizes of ``cfg``'s vision config (patch size, merge kernel; at most
    as many patches a side as its position table holds, as the release: 64 and 64), so a
    tiny model's processor cuts the patches its vision tower takes; None for a model
    without that vision tower."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or "vt_hidden_size" not in v:
        return None
    doc = json.loads(json.dumps(K3_PREPROCESSOR))
    media = doc["media_proc_cfg"]
    merge = v.get("merge_kernel_size", media["merge_kernel_size"])
    if isinstance(merge, list) and len(set(merge)) == 1:
        merge = merge[0]  # (the release's file writes one size for both axes)
    side = max(int(v.get("init_pos_emb_height", 64)), int(v.get("init_pos_emb_width", 64)))
    media.update(patch_size=v.get("patch_size", media["patch_size"]), merge_kernel_size=merge,
                 patch_limit_on_one_side=min(side, media["patch_limit_on_one_side"]),
                 in_patch_limit=min(side * side, media["in_patch_limit"]))  # fmt: skip
    return doc


def synthesize(
    *,
    config: str,
    out: str | Path,
    tiny: bool = False,
    overrides: dict | None = None,
    dtype: str | None = None,
    encoding: str = "auto",
    shard_mb: float = 0,
    seed: int = 0,
    force: bool = False,
    progress: bool = False,
) -> str:
    """Write the checkpoint; returns a one-paragraph summary."""
    if encoding not in ENCODINGS:
        raise ConfigError(f"--encoding must be one of {', '.join(ENCODINGS)}, not '{encoding}'.")
    raw = source_config(config)
    check_special_ids(raw, text_section(raw))  # before any weight is written
    o = dict(tiny_overrides(raw)) if tiny else {}
    o.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for k, v in o.items():
        if (isinstance(v, int) and v < 0) or (k != "mtp" and v == 0):
            raise ConfigError(f"--{k.replace('_', '-')} must be positive, got {v}.")
    cfg_raw = apply_overrides(raw, o, tiny)
    arch, cfg = resolve(cfg_raw, f"{config} (after overrides)")
    if dtype is None:
        src = str(
            text_section(raw).get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or ""
        )
        dtype = SHORT_NAMES.get(src, "bf16")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    tdtype = DTYPES[dtype]

    planned = [
        plan_instance(i, encoding_for(i, cfg_raw, encoding), tdtype, cfg_raw)
        for i in arch.instances(cfg)
    ]
    encs = {p.encoding for p in planned} - {"plain"}
    out_encoding = encs.pop() if len(encs) == 1 else "plain"
    total = sum(p.nbytes for p in planned)

    out = Path(out)
    groups = group_by_size(planned, lambda p: p.nbytes, int(shard_mb * (1 << 20)))
    names = shard_names(len(groups))
    source = Path(config) if Path(config).exists() else None  # a preset name reads no path
    with staged_output(out, force=force, need_bytes=total, source=source) as tmp:
        weight_map: dict[str, str] = {}
        with byte_bar(total=total, desc=f"synth {out.name}", disable=not progress) as bar:
            for fname, group in zip(names, groups, strict=True):
                entries = [e for p in group for e in p.parts]
                with SafetensorsWriter(tmp / fname, entries, {"format": "pt"}) as w:
                    for p in group:
                        tensors = _encode(p, tdtype, cfg_raw, seed)
                        for name, _, _ in p.parts:
                            w.write(name, tensors[name])
                            weight_map[name] = fname
                        bar.update(p.nbytes)
        if len(groups) > 1:
            write_index(tmp, weight_map, total)
        out_cfg = output_config(cfg_raw, out_encoding if encoding != "plain" else "plain", dtype)
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
        t = text_section(cfg_raw)
        tokenizer = write_tokenizer(tmp, cfg_raw, t, int(t["vocab_size"]))
        processor = preprocessor_config(cfg_raw)
        if processor is not None:  # what vLLM's Kimi K3 reads at start-up
            (tmp / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    n_params = sum(math.prod(p.inst.shape) for p in planned)
    return (
        f"wrote {out}: {arch.name} ({cfg_raw.get('model_type')}), {n_params:,} parameters, "
        f"{len(planned)} tensors, {total / 2**20:.1f} MiB in {len(groups)} file(s), dtype "
        f"{dtype}, encoding {out_encoding if encoding != 'plain' else 'plain'}; "
        + ("a byte-level tokenizer" if tokenizer else "no tokenizer (vocab under 256 + specials)")
    )
