"""Kimi K3 for vLLM 0.32's ``KimiK3ForConditionalGeneration`` (the ``nvidia`` variant,
which vLLM builds on every platform but ROCm): the parameters one rank's
``model.state_dict()`` holds, as ``sharded_state`` copies them, for the release's
quantization (MXFP4 routed experts, everything else bf16).

vLLM turns the release's compressed-tensors ``mxfp4-pack-quantized`` config into its own
``Mxfp4Config`` (``KimiK3ForConditionalGenerationConfig.verify_and_update_model_config``):
the routed experts take ``Mxfp4MoEMethod`` (packed uint8 ``w13_weight`` / ``w2_weight``,
E8M0 bytes as uint8 scales) and every other Linear stays unquantized. Per rank:

- KDA: ``in_proj_qkvgfab`` = the rank's rows of q, k, v, g, f_a whole, the rank's rows
  of b, zero rows to a multiple of 16; ``conv1d`` = q, k, v's rows in float32;
  ``dt_bias`` / ``A_log`` (the first ``num_heads`` of the stored vector) in float32.
- MLA: ``fused_qkv_a_g_proj`` = q_a and kv_a whole, then the rank's rows of the output
  gate; q_b / kv_b by heads, o_proj by input columns, unit attention scales.
- Latent MoE: router and latent projections whole, the router bias in float32 under
  ``experts.routed_experts``, shared experts split over tp, the experts' packed bytes
  copied as stored: w1 rows at 0 and w3 rows at ``Ip`` of ``w13_weight`` (``Ip``: the
  rank's width, at least 256 at tp > 1 without EP, zero past the real rows).
- Vision (MoonViT3d) split by heads when tp divides them, whole otherwise; the
  projector renamed (``proj.0`` / ``proj.2`` -> ``linear_1`` / ``linear_2``); the
  float32 input normalisation vLLM computes from ``preprocessor_config.json``.

Checked byte for byte against vLLM's own loader on CPU (``tests/test_vllm_kimi_k3.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

from ..checkpoint.bounded import read_json
from ..errors import ConfigError, short_repr
from .params import ALL, Param, Piece, Slicer
from .vllm_layers import MERGED, Rank, attention_scales, fused, pp_layers, row, swiglu, vocab_rows
from .vllm_moe import local_experts

LM = "language_model.model"
#: vLLM's KDA in_proj rows per rank are padded to a multiple of this
IN_PROJ_ALIGN = 16
#: KimiMoE's ``min_moe_intermediate_per_partition`` (tp > 1 without EP)
MIN_MOE_PER_RANK = 256
#: every MXFP4 MoE backend of vLLM 0.32 rounds the expert width up to a divisor of this
#: (Marlin / TRT-LLM / DeepGEMM 128, Humming 64, CPU 32): a width that is a multiple of
#: it is the same whichever backend the GPU picks at start-up
BACKEND_ROUND = 128
GROUP = 32  # MXFP4: one E8M0 scale per 32 values, two values per byte


def check_k3(ck, cfg) -> None:
    """Refuse, before anything is written, what vLLM's Kimi K3 class would not load."""
    qc = ck.config.get("text_config", {}).get("quantization_config") or ck.config.get(
        "quantization_config"
    )
    if not qc or qc.get("format") != "mxfp4-pack-quantized":
        raise ConfigError(
            f"{ck.root}: --target vllm writes Kimi K3 as released (MXFP4 routed experts, "
            f"the rest bf16): vLLM 0.32 serves K3 only through its Mxfp4Config; this "
            f"checkpoint's quantization is {(qc or {}).get('format', 'none')}."
        )
    t = cfg.text
    for n in ck.names():
        if ".experts." in n and ".shared_experts." not in n:
            if ck.meta(n).encoding != "mxfp4-pack-quantized":
                raise ConfigError(f"{ck.root}: routed expert '{n}' is not MXFP4-packed.")
        elif ck.meta(n).encoding != "plain":
            raise ConfigError(
                f"{ck.root}: '{n}' is {ck.meta(n).encoding}-encoded; vLLM's Mxfp4Config "
                f"loads every Linear but the routed experts unquantized (bf16)."
            )
    if t.num_mtp:
        raise ConfigError(f"{ck.root}: MTP layers are vLLM's draft model, not written here.")
    if not t.q_lora_rank:
        raise ConfigError(f"{ck.root}: MLA without a q LoRA rank is not written for vLLM.")
    if not t.full_rank_gate:
        raise ConfigError(f"{ck.root}: vLLM's K3 KDA needs use_full_rank_gate.")
    if not os.path.lexists(ck.root / "preprocessor_config.json"):  # a FIFO: refused below
        raise ConfigError(
            f"{ck.root}: no preprocessor_config.json: vLLM's Kimi K3 loads its image "
            f"processor at start-up and computes the vision input normalisation from it; "
            f"copy the release's file into the checkpoint."
        )
    _normalisation(ck)  # every field it uses, checked before anything is written


def k3_params(ck, cfg, dtype: torch.dtype, rank: Rank, roles: dict) -> Iterator[Param]:
    """Every parameter of vLLM's KimiK3ForConditionalGeneration on ``rank`` (``roles``:
    each tensor's, from ``validate_source``)."""
    t = cfg.text
    first, last = rank.pp == 0, rank.pp == rank.pp_size - 1
    src = Slicer(ck, t, dtype, roles)
    yield from _vision(src, cfg.vision, ck, rank)  # built on every pipeline stage
    if first:
        yield vocab_rows(src, rank, f"{LM}.embed_tokens.weight", f"{LM}.embed_tokens.weight")
    for i in pp_layers(t.num_layers, rank.pp, rank.pp_size):
        pre = f"{LM}.layers.{i}"
        if i in t.kda_layers:
            yield from _kda(src, rank, f"{pre}.self_attn")
        else:
            yield from _mla(src, rank, f"{pre}.self_attn")
        if i in t.moe_layers:
            yield from _latent_moe(src, rank, f"{pre}.block_sparse_moe")
        else:
            yield from swiglu(src, rank, f"{pre}.mlp", f"{pre}.mlp")
        norms = ["input_layernorm", "post_attention_layernorm"]
        if t.attn_res_block_size:
            norms += ["self_attention_res_norm", "mlp_res_norm"]
            norms += ["self_attention_res_proj", "mlp_res_proj"]
        for n in norms:
            yield src.whole(f"{pre}.{n}.weight", dtype)
    if not last:
        return
    yield src.whole(f"{LM}.norm.weight", dtype)
    if t.attn_res_block_size:
        for n in ("output_attn_res_norm", "output_attn_res_proj"):
            yield src.whole(f"{LM}.{n}.weight", dtype)
    yield vocab_rows(src, rank, "language_model.lm_head.weight", "language_model.lm_head.weight")


def _rows(src: Slicer, name: str, a: int, b: int, dt: torch.dtype) -> Param:
    """Rows [a, b) of a plain tensor (a 1-D vector, or [1, 1, H, 1] viewed as 1-D)."""
    shape = src.ck.meta(name).main.shape
    lead = len(shape) == 4  # A_log stored as [1, 1, H, 1]
    sl = (slice(None), slice(None), slice(a, b), slice(None)) if lead else (slice(a, b),)

    def make():
        v = src.ck.get(name)[sl]
        return v.reshape(b - a, *(() if lead else v.shape[1:])).to(dt)

    rest = () if lead else tuple(shape[1:])
    return Param(name, dt, (b - a, *rest), make, pieces=(Piece(name, None, sl, ALL),))


def _f32(params: Iterator[Param]) -> Iterator[Param]:
    for p in params:
        p.dtype = torch.float32
        if p.stacked is not None:
            p.stacked = lambda s=p.stacked: (t.float() for t in s())
        else:
            p.make = lambda m=p.make: m().float()
        yield p


def _kda(src: Slicer, rank: Rank, at: str) -> Iterator[Param]:
    """KDA: ``in_proj_qkvgfab`` (the rank's heads of q, k, v, g, the replicated f_a and
    its heads of b, padded to vLLM's alignment), the short convolutions, the decay
    parameters, ``f_b_proj``, the output norm and ``o_proj``: each split as its role
    says (KDA heads)."""
    t, tp, r = src.cfg, rank.tp_size, rank.tp
    heads = t.kda_num_heads
    if heads % tp:
        raise ConfigError(f"tp={tp} must divide the {heads} KDA heads.")
    hp = heads // tp

    def span(name: str) -> tuple[int, int, int]:
        return src.span(f"{at}.{name}", r, tp)

    # f_a_proj: replicated inside the tp-split parameter
    names = [f"{x}_proj" for x in "qkvg"] + ["f_a_proj", "b_proj"]
    spans = {m: span(f"{m}.weight") for m in names}
    for p in fused(src, at, "in_proj_qkvgfab", spans):
        pad = -p.shape[0] % IN_PROJ_ALIGN
        if pad:  # zero rows vLLM adds to align each rank's block
            p.shape = (p.shape[0] + pad, *p.shape[1:])
            if p.stacked is not None:
                zeros = torch.zeros(pad, *p.shape[1:], dtype=p.dtype)
                p.stacked = lambda s=p.stacked, z=zeros: (*s(), z)
            else:
                p.make = lambda m=p.make, pad=pad: torch.nn.functional.pad(m(), (0, 0, 0, pad))
        yield p
    conv = {f"{x}_conv1d": span(f"{x}_conv1d.weight") for x in "qkv"}
    yield from _f32(fused(src, at, "conv1d", conv))
    yield _rows(src, f"{at}.dt_bias", *span("dt_bias")[:2], torch.float32)
    # (A_log: a release pads it past the heads, which the stream narrows; one per head)
    yield _rows(src, f"{at}.A_log", r * hp, (r + 1) * hp, torch.float32)
    yield from fused(src, at, "f_b_proj", {"f_b_proj": span("f_b_proj.weight")})
    yield src.whole(f"{at}.o_norm.weight", src.dtype)
    a, b, full = span("o_proj.weight")
    yield from row(src, f"{at}.o_proj", a, b - a, full)


def _mla(src: Slicer, rank: Rank, at: str) -> Iterator[Param]:
    """K3's MLA: the replicated latents (with the output gate's rows of this rank's
    heads), the latent norms, ``q_b_proj`` / ``kv_b_proj`` by heads, ``o_proj`` by input
    columns: each split as its role says."""
    t = src.cfg  # (tp dividing the heads: vllm_write.check_layout, then the spans)

    def span(module: str) -> tuple[int, int, int]:
        return src.span(f"{at}.{module}.weight", rank.tp, rank.tp_size)

    spans = {m: span(m) for m in MERGED["fused_qkv_a_proj"]}
    merged = "fused_qkv_a_proj"
    if t.mla_output_gate:  # the output gate's rows joined to the replicated latents
        spans["g_proj"] = span("g_proj")
        merged = "fused_qkv_a_g_proj"
    yield from fused(src, at, merged, spans)
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        yield src.whole(f"{at}.{norm}.weight", src.dtype)
    for proj in ("q_b_proj", "kv_b_proj"):
        yield from fused(src, at, proj, {proj: span(proj)})
    a, b, full = span("o_proj")
    yield from row(src, f"{at}.o_proj", a, b - a, full)
    yield from attention_scales(at, src.dtype, False)


def _latent_moe(src: Slicer, rank: Rank, moe: str) -> Iterator[Param]:
    t, ck = src.cfg, src.ck
    yield src.whole(f"{moe}.gate.weight", src.dtype)
    bias = f"{moe}.gate.e_score_correction_bias"
    if bias in ck:
        p = src.whole(bias, torch.float32)
        p.name = f"{moe}.experts.routed_experts.e_score_correction_bias"
        yield p
    if t.num_shared_experts:
        shared = f"{moe}.experts._shared_experts._layer"
        yield from swiglu(src, rank, f"{moe}.shared_experts", shared)
    if t.latent_size:
        yield src.whole(f"{moe}.routed_expert_down_proj.weight", src.dtype)
        out = f"{moe}.experts.routed_output_transform"
        if t.latent_norm:
            p = src.whole(f"{moe}.routed_expert_norm.weight", src.dtype)
            p.name = f"{out}.norm.weight"
            yield p
        p = src.whole(f"{moe}.routed_expert_up_proj.weight", src.dtype)
        p.name = f"{out}.up_proj.weight"
        yield p
    yield from _mxfp4_experts(src, rank, moe)


def _mxfp4_experts(src: Slicer, rank: Rank, moe: str) -> Iterator[Param]:
    """``w13_weight`` [E_local, 2 Ip, X / 2], ``w13_weight_scale`` [.., X / 32],
    ``w2_weight`` [E_local, X, Ip / 2], ``w2_weight_scale`` [.., Ip / 32]: the stored
    bytes, the rank's rows of w1 at 0 and of w3 at Ip, zero elsewhere."""
    t, ck, tp = src.cfg, src.ck, rank.tp_size
    n, inter = t.num_experts, t.moe_intermediate_size
    width = t.latent_size or t.hidden_size
    if rank.ep:
        experts, lo, hi, ip = local_experts(n, rank.tp, tp), 0, inter, inter
    else:
        if inter % tp:
            raise ConfigError(f"tp={tp} does not divide moe_intermediate_size {inter}.")
        per = inter // tp
        experts, lo, hi = range(n), rank.tp * per, (rank.tp + 1) * per
        ip = max(per, MIN_MOE_PER_RANK) if tp > 1 else per
    real = hi - lo
    if real % GROUP or ip % BACKEND_ROUND:
        raise ConfigError(
            f"{moe}: the experts' per-rank width {real} (held as {ip}) must be a multiple "
            f"of {GROUP} (an MXFP4 scale group) and {ip} of {BACKEND_ROUND} (vLLM's MXFP4 "
            f"MoE backends pad it to a multiple they pick on the GPU at start-up, which "
            f"an offline writer cannot know); pick another tp, or --ep {tp}."
        )
    ex = f"{moe}.experts"
    for e in range(n):  # metadata only
        for w, shape in (("w1", (inter, width)), ("w3", (inter, width)), ("w2", (width, inter))):
            parts = ck.meta(f"{ex}.{e}.{w}.weight").parts
            got = tuple(parts["weight_packed"].shape)
            if got != (shape[0], shape[1] // 2):
                raise ConfigError(
                    f"{ex}.{e}.{w}: packed {got}, expected {shape[0]} x {shape[1] // 2}."
                )
            if parts["weight_scale"].dtype != torch.uint8:  # vLLM's parameter: E8M0 bytes
                raise ConfigError(
                    f"{ex}.{e}.{w}: MXFP4 scales stored as {parts['weight_scale'].dtype}; "
                    f"written only as the release stores them (uint8 E8M0 bytes)."
                )

    def w13(part: str, cols: int):
        def gen():
            for e in experts:
                blk = torch.zeros(1, 2 * ip, cols, dtype=torch.uint8)
                for half, w in ((0, "w1"), (1, "w3")):
                    stored = ck.part_tensor(f"{ex}.{e}.{w}.weight", part)
                    blk[0, half * ip : half * ip + real] = stored[lo:hi]
                yield blk

        return gen

    def w2(part: str, per: int):
        def gen():
            for e in experts:
                blk = torch.zeros(1, width, ip // per, dtype=torch.uint8)
                v = ck.part_tensor(f"{ex}.{e}.w2.weight", part)
                blk[0, :, : real // per] = v[:, lo // per : hi // per]
                yield blk

        return gen

    el = len(experts)
    for part, suffix, per in (("weight_packed", "", 2), ("weight_scale", "_scale", GROUP)):
        pieces = []
        for i, e in enumerate(experts):
            at = slice(i, i + 1)
            pieces += [
                Piece(f"{ex}.{e}.w1.weight", part, (slice(lo, hi),), (at, slice(0, real))),
                Piece(f"{ex}.{e}.w3.weight", part, (slice(lo, hi),), (at, slice(ip, ip + real))),
            ]
        cols = width // per
        yield Param(f"{ex}.routed_experts.w13_weight{suffix}", torch.uint8, (el, 2 * ip, cols),
                    None, w13(part, cols), tuple(pieces))  # fmt: skip
        pieces = [
            Piece(
                f"{ex}.{e}.w2.weight",
                part,
                (slice(None), slice(lo // per, hi // per)),
                (slice(i, i + 1), slice(None), slice(0, real // per)),
            )
            for i, e in enumerate(experts)
        ]
        yield Param(f"{ex}.routed_experts.w2_weight{suffix}", torch.uint8,
                    (el, width, ip // per), None, w2(part, per), tuple(pieces))  # fmt: skip


def _vision(src: Slicer, vc, ck, rank: Rank) -> Iterator[Param]:
    """MoonViT3d and the projector. vLLM splits the tower over tp only when tp divides
    its heads (``mm_encoder_tp_mode`` "weights", the default), else every rank holds it
    whole."""
    tp = rank.tp_size if vc.num_heads % rank.tp_size == 0 else 1
    r = rank.tp if tp > 1 else 0
    vt = "vision_tower"
    yield src.whole(f"{vt}.patch_embed.proj.weight", src.dtype)
    if f"{vt}.patch_embed.proj.bias" in ck:
        yield src.whole(f"{vt}.patch_embed.proj.bias", src.dtype)
    yield from _input_norm(ck)
    yield src.whole(f"{vt}.patch_embed.pos_emb.weight", src.dtype)
    q, iv = vc.qkv_hidden_size, vc.intermediate_size
    qa, qb = r * q // tp, (r + 1) * q // tp
    ia, ib = r * iv // tp, (r + 1) * iv // tp
    for b in range(vc.num_layers):
        blk = f"{vt}.encoder.blocks.{b}"
        if any(f"{blk}.{m}.bias" in ck for m in ("wqkv", "wo", "mlp.fc0", "mlp.fc1")):
            raise ConfigError(f"{blk}: vision biases are not written for vLLM yet.")
        for n in ("norm0", "norm1"):
            yield src.whole(f"{blk}.{n}.weight", src.dtype)
        yield _qkv_heads(src, f"{blk}.wqkv.weight", q, qa, qb)
        yield from row(src, f"{blk}.wo", qa, qb - qa, q)
        yield from fused(src, f"{blk}.mlp", "fc0", {"fc0": (ia, ib, iv)})
        yield from row(src, f"{blk}.mlp.fc1", ia, ib - ia, iv)
    yield src.whole(f"{vt}.encoder.final_layernorm.weight", src.dtype)
    for n in sorted(x for x in ck.names() if x.startswith("mm_projector.")):
        p = src.whole(n, src.dtype)
        p.name = n.replace(".proj.0.", ".linear_1.").replace(".proj.2.", ".linear_2.")
        yield p


def _qkv_heads(src: Slicer, name: str, q: int, a: int, b: int) -> Param:
    """The rank's rows [a, b) of each of q, k and v in MoonViT's fused ``wqkv``."""
    n = b - a
    pieces = tuple(
        Piece(name, None, (slice(j * q + a, j * q + b),), (slice(j * n, (j + 1) * n),))
        for j in range(3)
    )
    shape = src.ck.meta(name).main.shape

    def make():
        w = src.ck.get(name)
        return torch.cat([w[j * q + a : j * q + b] for j in range(3)]).to(src.dtype)

    return Param(name, src.dtype, (3 * n, *shape[1:]), make, pieces=pieces)


#: image channels MoonViT's patch embedding takes (RGB): image_mean / image_std hold one
#: value per channel
CHANNELS = 3
#: sizes vLLM's Kimi K3 image processor reads from the file at start-up (an int, or one per
#: spatial axis)
SIZES = ("patch_size", "merge_kernel_size", "temporal_merge_kernel_size")


def _normalisation(ck) -> tuple[float, list[float], list[float]]:
    """(rescale, mean, std) of ``preprocessor_config.json``, resolved as vLLM resolves
    them; every field used is checked first: one ConfigError line naming the file and
    the key, never a traceback and never a non-finite or divide-by-zero buffer."""
    path = ck.root / "preprocessor_config.json"
    doc = read_json(path, "processor", ConfigError, finite=True)
    fix = "fix it, or copy the release's preprocessor_config.json into the checkpoint"

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{path}: {key} {what}; {fix}.")

    conf, at = doc, ""
    for key in ("image_processor", "media_proc_cfg"):
        if key in conf:
            conf, at = conf[key], f"{at}{key}."
            if not isinstance(conf, dict):
                raise bad(at[:-1], f"must be a JSON object, got {type(conf).__name__}")

    for key in SIZES:
        v = conf.get(key)
        vs = v if isinstance(v, list) and v else [v]
        if key in conf and not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vs
        ):
            want = "must be a positive integer (or a list of them)"
            raise bad(f"{at}{key}", f"{want}, got {short_repr(v)}")
    for key in ("do_rescale", "do_normalize"):
        if key in conf and not isinstance(conf[key], bool):
            raise bad(f"{at}{key}", f"must be true or false, got {short_repr(conf[key])}")

    def number(key: str, v, positive: bool) -> float:
        x = math.nan
        if isinstance(v, int | float) and not isinstance(v, bool):
            with contextlib.suppress(OverflowError):  # an integer literal of 400 digits
                x = float(v)
        if not math.isfinite(x) or (positive and x <= 0):
            want = "a finite number > 0" if positive else "a finite number"
            raise bad(key, f"must be {want}, got {short_repr(v)}")
        return x

    has = "image_mean" in conf and "image_std" in conf
    rescale = 1.0
    if conf.get("do_rescale", has):
        rescale = number(f"{at}rescale_factor", conf.get("rescale_factor", 1 / 255), True)
    if not conf.get("do_normalize", has):
        return rescale, [0.0] * CHANNELS, [1.0] * CHANNELS
    out = []
    for key, positive in (("image_mean", False), ("image_std", True)):
        if key not in conf:
            raise bad(f"{at}{key}", "is missing (do_normalize is true)")
        v = conf[key]
        if not isinstance(v, list) or len(v) != CHANNELS:
            got = f"{len(v)} values" if isinstance(v, list) else short_repr(v)
            raise bad(f"{at}{key}", f"must be a list of {CHANNELS} numbers (one per RGB "
                                    f"channel), got {got}")  # fmt: skip
        out.append([number(f"{at}{key}[{i}]", x, positive) for i, x in enumerate(v)])
    m, s = (torch.tensor(x, dtype=torch.float32) for x in out)  # as _input_norm computes
    for what, v in (
        ("rescale_factor / image_std", rescale / s),
        ("image_mean / image_std", -m / s),
    ):
        if not bool(torch.isfinite(v).all()):
            raise bad(f"{at}{what}", "is not a finite float32 (vLLM's input_norm buffers)")
    return rescale, out[0], out[1]


def _input_norm(ck) -> Iterator[Param]:
    """vLLM's ``FusedMMInputNorm`` buffers (``weight = rescale / std``, ``bias = -mean /
    std``, float32), resolved from ``preprocessor_config.json`` as vLLM resolves them;
    none when the normalisation is the identity."""
    rescale, mean, std = _normalisation(ck)
    pairs = list(zip(mean, std, strict=True))
    if all(math.isclose(rescale / s, 1.0, rel_tol=1e-5, abs_tol=1e-8)
           and math.isclose(m / s, 0.0, abs_tol=1e-8) for m, s in pairs):  # fmt: skip
        return  # vLLM's IdentityInputNorm: no buffers
    m, s = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    w, b = rescale / s, -m / s
    for name, v in (("weight", w), ("bias", b)):
        yield Param(f"vision_tower.patch_embed.input_norm.{name}", torch.float32, tuple(v.shape),
                    lambda v=v: v.clone())  # fmt: skip


def carried_shapes(ck, cfg) -> dict[str, tuple[int, ...]]:
    """Tensors vLLM holds only a prefix of: the release pads ``A_log`` past the KDA heads
    (the runtime, like vLLM, reads only the first ``num_heads``), so a vLLM directory
    carries [num_heads] of it."""
    t = cfg.text
    if not t.a_log_stored:
        return {}
    return {
        f"{LM}.layers.{i}.self_attn.A_log": tuple(t.a_log_shape)
        for i in range(t.num_layers)
        if i in t.kda_layers
    }
