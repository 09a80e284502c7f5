"""vLLM's FusedMoE parameters for ``shard --target vllm`` (qwen3_moe, deepseek_v3 /
kimi_k2): the router, the shared experts as a dense MLP, and the routed experts stacked
(``w13_*`` = gate rows then up rows, ``w2_*`` = down's input columns) for every stored
part - unquantized; FP8 (channel or block scales) or int8 (channel) codes; int4 / int8
weight-only (``*_weight_packed`` / ``*_weight_scale`` / ``*_weight_shape``, zero points);
NVFP4 (packed FP4, FP8 group scales, per-tensor global scales) - split over tp, or placed
whole under expert parallelism as vLLM 0.32 places experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..checkpoint import Checkpoint
from ..errors import ConfigError
from .params import ALL, Param, Piece, Slicer
from .vllm_layers import Rank, input_granule, input_slice_problem, last_loaded, swiglu


def local_experts(n: int, ep_rank: int, ep_size: int) -> range:
    """The experts vLLM 0.32 places on EP rank ``ep_rank`` (``determine_expert_map``,
    "linear": contiguous blocks, the remainder one each on the first ranks)."""
    base, rem = divmod(n, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return range(start, start + base + (ep_rank < rem))


def fused_moe(src: Slicer, rank: Rank, mlp: str) -> Iterator[Param]:
    """vLLM's FusedMoE: the router (``experts.gate``, the name ``_filter_subtensors``
    keeps for the module both the block and its FusedMoE hold) whole, and the experts
    stacked: ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight``
    [E, H, I]. Under EP each rank holds its experts whole; under TP every expert's I is
    split. Written one expert at a time (``write_stacked``)."""
    cfg, ck, tp = src.cfg, src.ck, rank.tp_size
    n, inter = cfg.num_experts, cfg.moe_intermediate_size
    router = src.whole(f"{mlp}.gate.weight", src.dtype)
    router.name = f"{mlp}.experts.gate.weight"
    yield router
    if f"{mlp}.gate.e_score_correction_bias" in ck:  # DeepSeek-V3's, kept in float32
        bias = src.whole(f"{mlp}.gate.e_score_correction_bias", torch.float32)
        bias.name = f"{mlp}.experts.gate.e_score_correction_bias"
        yield bias
    if getattr(cfg, "num_shared_experts", 0):  # FusedMoE holds the shared expert's MLP
        shared = f"{mlp}.experts._shared_experts._layer"
        yield from swiglu(src, rank, f"{mlp}.shared_experts", shared)
    ex = f"{mlp}.experts"
    parts = _expert_parts(ck, ex, n)
    if not rank.ep and tp > n:
        raise ConfigError(f"tp={tp} is greater than the {n} experts (vLLM refuses it).")
    experts = local_experts(n, rank.tp, tp) if rank.ep else range(n)
    # each expert's intermediate rows on this rank, as the roles split them (whole: EP)
    lo, hi, _ = src.span(f"{ex}.0.gate_proj.weight", rank.tp, tp, rank.ep)
    q = ck.meta(f"{ex}.0.down_proj.weight").quant
    strategy = q.extra.get("strategy") if q else None
    if strategy == "block" and (hi - lo) % q.block[0]:  # as vLLM's validate_fp8_block_shape_moe
        raise ConfigError(
            f"'{ex}': {hi - lo} intermediate rows per rank are not whole FP8 blocks of "
            f"{q.block[0]} (vLLM refuses them); pick a tp that keeps whole blocks, or --ep."
        )
    down = input_granule(ck, f"{ex}.0.down_proj")
    why = input_slice_problem(hi - lo, *down) if hi - lo < inter else None
    if why:
        raise ConfigError(f"'{ex}.*.down_proj': {why}; pick a tp it divides, or --ep.")
    for part, (dt13, shape13), (dt2, shape2) in parts:
        name13, name2 = f"{ex}.routed_experts.w13_{part}", f"{ex}.routed_experts.w2_{part}"
        if part == "weight_shape":  # [out, in] per expert, in vLLM's model dtype (one row)
            yield from _expert_shapes(src, ex, experts, name13, name2)
            continue
        if part == "input_scale":  # a static FP8 input scale: [E] for w13 (gate's = up's)
            yield from _expert_input_scales(src, ex, experts, name13, name2)
            continue
        if shape13 == (1,):  # a per-tensor scale: [E, 2] (gate's, up's) and [E] (down's)
            yield from _expert_tensor_scales(src, ex, experts, part, dt13, name13, name2)
            continue
        # an unquantized weight takes the model dtype; codes (FP8, packed int) and scales stay
        cast = (
            src.dtype if dt13.is_floating_point and dt13.itemsize > 1 and part == "weight" else None
        )
        dt13, dt2 = cast or dt13, cast or dt2
        # gate / up rows [lo, hi) of I in the part's rows (a zero point packs them per
        # int32), down's input columns (packed, groups, blocks; a per-channel scale is
        # whole): the format registry's axis maps, as for every other Linear
        r0, r1 = src.cut(f"{ex}.0.gate_proj", part, 0, lo, hi, inter) or (0, shape13[0])
        rows, cut = r1 - r0, slice(r0, r1)
        cols2 = shape2[1] if len(shape2) > 1 else 0
        a2, b2 = src.cut(f"{ex}.0.down_proj", part, 1, lo, hi, inter) or (0, cols2)

        def w13(part=part, cast=cast, cut=cut):  # gate's rows, then up's: mapped views
            for e in experts:
                for m in ("gate_proj", "up_proj"):
                    t = ck.part_tensor(f"{ex}.{e}.{m}.weight", part)[cut]
                    yield t.to(cast) if cast else t

        def w2(part=part, cast=cast, a2=a2, b2=b2):
            for e in experts:
                t = ck.part_tensor(f"{ex}.{e}.down_proj.weight", part)[:, a2:b2]
                yield (t.to(cast) if cast else t)[None]

        p13, p2 = [], []
        for i, e in enumerate(experts):
            at = slice(i, i + 1)  # dst keeps the expert dim (a [1, ...] block)
            p13 += [
                Piece(f"{ex}.{e}.gate_proj.weight", part, (cut,), (at, slice(0, rows))),
                Piece(f"{ex}.{e}.up_proj.weight", part, (cut,), (at, slice(rows, 2 * rows))),
            ]
            p2.append(
                Piece(f"{ex}.{e}.down_proj.weight", part, (slice(None), slice(a2, b2)), (at,))
            )
        n_e = len(experts)
        yield Param(name13, dt13, (n_e, 2 * rows, shape13[1]), None, w13, tuple(p13))
        yield Param(name2, dt2, (n_e, shape2[0], b2 - a2), None, w2, tuple(p2))


def _per_expert(ck: Checkpoint, name: str, part: str, dtype: torch.dtype, tail: tuple,
                held: list[tuple[str, tuple[str, ...]]]) -> Param:  # fmt: skip
    """``part`` of one module per expert, stacked [E, *tail]: ``held`` is, per expert, the
    module whose value vLLM keeps and the modules that value stands for (``verify`` reads
    it back for each)."""

    def values():
        for kept, _ in held:
            yield ck.part_tensor(f"{kept}.weight", part).to(dtype).reshape(1, *tail)

    pieces = tuple(
        Piece(f"{m}.weight", part, ALL, (slice(i, i + 1),))
        for i, (_, members) in enumerate(held)
        for m in members
    )
    return Param(name, dtype, (len(held), *tail), None, values, pieces)


def _downs(ex: str, experts) -> list[tuple[str, tuple[str, ...]]]:
    return [(f"{ex}.{e}.down_proj", (f"{ex}.{e}.down_proj",)) for e in experts]


def _expert_tensor_scales(
    src: Slicer, ex: str, experts, part: str, dtype: torch.dtype, name13: str, name2: str
) -> Iterator[Param]:
    """A per-tensor part of every expert (NVFP4's global scales, a calibrated FP8
    weight's scale): FusedMoE holds gate's and up's side by side, [E, 2], and down's as
    [E], whole on every tp rank."""
    ck = src.ck

    def w13():
        for e in experts:
            g, u = (ck.part_tensor(f"{ex}.{e}.{m}.weight", part) for m in ("gate_proj", "up_proj"))
            yield torch.cat([g.reshape(1), u.reshape(1)])[None]

    p13 = tuple(
        Piece(f"{ex}.{e}.{m}.weight", part, ALL, (slice(i, i + 1), slice(j, j + 1)))
        for i, e in enumerate(experts)
        for j, m in enumerate(("gate_proj", "up_proj"))
    )
    yield Param(name13, dtype, (len(experts), 2), None, w13, p13)
    yield _per_expert(ck, name2, part, dtype, (), _downs(ex, experts))


def _expert_input_scales(src: Slicer, ex: str, experts, name13: str, name2: str):
    """Static FP8 input scales: FusedMoE holds one per expert for gate and up together
    (they read the same input; vLLM's loader refuses two that differ by more than 1e-5 and
    keeps the last it read, which ``verify`` then reads back for both) and one for down.
    Two that differ are refused before writing, for a checkpoint whose values are
    stored; a planned one (``convert``: computed when read) shares one input scale per
    fused set by construction, and a metadata-only one (``verify`` of a one-pass
    directory) has no values: the rank files hold what was checked."""
    ck = src.ck
    w13 = []
    for e in experts:
        gate, up = f"{ex}.{e}.gate_proj", f"{ex}.{e}.up_proj"
        if not ck.values_stored:  # (checked where the values were stored: see the doc)
            w13.append((last_loaded(ck, [gate, up], "input_scale"), (gate, up)))
            continue
        g, u = (ck.part_tensor(f"{m}.weight", "input_scale") for m in (gate, up))
        if float((g - u).abs().max()) > 1e-5:
            raise ConfigError(
                f"'{ex}.{e}': gate_proj's input scale {float(g.max())} and up_proj's "
                f"{float(u.max())} differ; vLLM's FusedMoE holds one for both (and refuses "
                f"this checkpoint). Re-calibrate with one scale for gate and up."
            )
        w13.append((last_loaded(ck, [gate, up], "input_scale"), (gate, up)))
    yield _per_expert(ck, name13, "input_scale", torch.float32, (), w13)
    yield _per_expert(ck, name2, "input_scale", torch.float32, (), _downs(ex, experts))


def _expert_shapes(src: Slicer, ex: str, experts, name13: str, name2: str) -> Iterator[Param]:
    """Packed experts' ``weight_shape``: vLLM's FusedMoE holds one [out, in] row per
    expert in the model dtype (the unsplit shape of gate or up: the last it read)."""
    ck, dt = src.ck, src.dtype
    w13 = []
    for e in experts:
        kept = last_loaded(ck, [f"{ex}.{e}.gate_proj", f"{ex}.{e}.up_proj"], "weight_shape")
        w13.append((kept, (kept,)))  # (verify rebuilds the other's shape)
    yield _per_expert(ck, name13, "weight_shape", dt, (2,), w13)
    yield _per_expert(ck, name2, "weight_shape", dt, (2,), _downs(ex, experts))


def _expert_ok(meta) -> bool:
    """Whether vLLM 0.32's FusedMoE method for this expert's scheme is written here:
    unquantized; FP8 with per-channel or block scales and dynamic activations, or per
    tensor with static ones, and int8 with per-channel scales and dynamic activations
    (the W8A8 FP8 / int8 methods: ``w13_weight`` + ``w13_weight_scale``); int4 / int8
    weight-only with channel or group scales, symmetric or with zero points (WNA16:
    ``w13_weight_packed`` / ``_scale`` / ``_shape`` / ``_zero_point``); NVFP4 with its
    activation global scale (W4A4 NVFP4: ``w13_weight_packed`` / ``_scale`` /
    ``_global_scale``, ``w13_input_global_scale``)."""
    q, enc = meta.quant, meta.encoding
    strategy = (q.extra if q else {}).get("strategy")
    if enc == "plain":
        return True
    if enc == "float-quantized":  # (per tensor: with its static input scale, ``fp8``)
        return strategy in ("channel", "block") or (
            strategy == "tensor" and "input_scale" in meta.parts
        )
    if enc == "int-quantized" and q.num_bits == 8:
        return strategy == "channel"
    if enc == "pack-quantized":
        return q.num_bits in (4, 8)
    return enc == "nvfp4-pack-quantized" and "input_global_scale" in meta.parts


def _expert_parts(ck: Checkpoint, ex: str, n: int) -> list:
    """(part, (dtype, shape) of gate / up, (dtype, shape) of down) of every expert's
    stored parts, the same for all, for the schemes ``_expert_ok`` takes. Others are
    refused before writing."""
    first = None
    for e in range(n):
        got = []
        for m in ("gate_proj", "up_proj", "down_proj"):
            meta = ck.meta(f"{ex}.{e}.{m}.weight")
            if not _expert_ok(meta):
                q = meta.quant
                what = f"{meta.encoding}, {q.num_bits} bits, {q.extra.get('strategy')}"
                raise ConfigError(
                    f"'{ex}.{e}.{m}' is {what}: vLLM's FusedMoE parameters are written for "
                    f"bf16 / fp16, FP8 per-channel or block, int8 per-channel (dynamic "
                    f"activations), int4 / int8 weight-only and NVFP4 experts "
                    f"(docs/vllm-target.md)."
                )
            got.append({k: (p.dtype, tuple(p.shape)) for k, p in meta.parts.items()})
        if got[0] != got[1] or list(got[0]) != list(got[2]):
            raise ConfigError(f"'{ex}.{e}': gate, up and down are stored differently.")
        sig = [(k, got[0][k], got[2][k]) for k in got[0]]
        if first is not None and sig != first:
            raise ConfigError(f"'{ex}.{e}' is stored differently from expert 0.")
        first = sig
    return first


__all__ = ["fused_moe", "local_experts"]
