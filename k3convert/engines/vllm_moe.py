"""vLLM's FusedMoE parameters for ``shard --target vllm`` (qwen3_moe, deepseek_v3 /
kimi_k2): the router, the shared experts as a dense MLP, and the routed experts stacked
(``w13_*`` = gate rows then up rows, ``w2_*`` = down's input columns) for every stored
part - unquantized, FP8 with per-channel scales, or int4 weight-only with group scales
(``*_weight_packed`` / ``*_weight_scale`` / ``*_weight_shape``) - split over tp, or placed
whole under expert parallelism as vLLM 0.32 places experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..checkpoint import Checkpoint
from ..errors import ConfigError
from .vllm_sharded import ALL, Param, Piece, Rank, _scaled, _Source, _swiglu


def local_experts(n: int, ep_rank: int, ep_size: int) -> range:
    """The experts vLLM 0.32 places on EP rank ``ep_rank`` (``determine_expert_map``,
    "linear": contiguous blocks, the remainder one each on the first ranks)."""
    base, rem = divmod(n, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return range(start, start + base + (ep_rank < rem))


def fused_moe(src: _Source, rank: Rank, mlp: str) -> Iterator[Param]:
    """vLLM's FusedMoE: the router (``experts.gate``, the name ``_filter_subtensors``
    keeps for the module both the block and its FusedMoE hold) whole, and the experts
    stacked: ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight``
    [E, H, I]. Under EP each rank holds its experts whole; under TP every expert's I is
    split. Written one expert at a time (``write_stacked``)."""
    cfg, ck, tp = src.cfg, src.ck, rank.tp_size
    n, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    router = src.whole(f"{mlp}.gate.weight", src.dtype)
    router.name = f"{mlp}.experts.gate.weight"
    yield router
    if f"{mlp}.gate.e_score_correction_bias" in ck:  # DeepSeek-V3's, kept in float32
        bias = src.whole(f"{mlp}.gate.e_score_correction_bias", torch.float32)
        bias.name = f"{mlp}.experts.gate.e_score_correction_bias"
        yield bias
    if getattr(cfg, "num_shared_experts", 0):  # FusedMoE holds the shared expert's MLP
        yield from _swiglu(src, rank, f"{mlp}.shared_experts",
                           f"{mlp}.experts._shared_experts._layer",
                           cfg.moe_intermediate_size * cfg.num_shared_experts)  # fmt: skip
    ex = f"{mlp}.experts"
    parts = _expert_parts(ck, ex, n)
    if rank.ep:
        experts, lo, hi = local_experts(n, rank.tp, tp), 0, inter
    else:
        if tp > n:
            raise ConfigError(f"tp={tp} is greater than the {n} experts (vLLM refuses it).")
        if inter % tp:
            raise ConfigError(f"tp={tp} does not divide moe_intermediate_size {inter}.")
        experts, lo, hi = range(n), rank.tp * inter // tp, (rank.tp + 1) * inter // tp
    rows, cut = hi - lo, slice(lo, hi)
    for part, (dt13, cols13), (dt2, cols2) in parts:
        suffix = "" if part == "weight" else part.removeprefix("weight")
        name13, name2 = (
            f"{ex}.routed_experts.w13_weight{suffix}",
            f"{ex}.routed_experts.w2_weight{suffix}",
        )
        if part == "weight_shape":  # [out, in] per expert, in vLLM's model dtype (one row)
            yield from _expert_shapes(src, ex, experts, name13, name2)
            continue
        # an unquantized weight takes the model dtype; codes (FP8, packed int) and scales stay
        cast = (
            src.dtype if dt13.is_floating_point and dt13.itemsize > 1 and part == "weight" else None
        )
        dt13, dt2 = cast or dt13, cast or dt2
        grouped = cols2 > 1 or part == "weight"  # down's input columns (packed, or groups)
        a2, b2 = (
            _scaled(cols2, inter, lo, hi, f"{ex}.*.down_proj.{part}") if grouped else (0, cols2)
        )

        def w13(part=part, cast=cast):
            for e in experts:
                g, u = (
                    ck.get_parts(f"{ex}.{e}.{m}.weight")[part][lo:hi]
                    for m in ("gate_proj", "up_proj")
                )
                t = torch.cat([g, u])
                yield (t.to(cast) if cast else t)[None]

        def w2(part=part, cast=cast, a2=a2, b2=b2):
            for e in experts:
                t = ck.get_parts(f"{ex}.{e}.down_proj.weight")[part][:, a2:b2]
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
        yield Param(name13, dt13, (n_e, 2 * rows, cols13), None, w13, tuple(p13))
        yield Param(name2, dt2, (n_e, hidden, b2 - a2), None, w2, tuple(p2))


def _expert_shapes(src: _Source, ex: str, experts, name13: str, name2: str) -> Iterator[Param]:
    """Packed experts' ``weight_shape``: vLLM's FusedMoE holds one [out, in] row per
    expert in the model dtype (the unsplit shape, the last of gate / up it loaded)."""
    ck, dt = src.ck, src.dtype
    for name, member in ((name13, "up_proj"), (name2, "down_proj")):

        def rows(member=member):
            for e in experts:
                yield ck.get_parts(f"{ex}.{e}.{member}.weight")["weight_shape"].to(dt)[None]

        pieces = tuple(
            Piece(f"{ex}.{e}.{member}.weight", "weight_shape", ALL, (slice(i, i + 1),))
            for i, e in enumerate(experts)
        )
        yield Param(name, dt, (len(experts), 2), None, rows, pieces)


def _expert_parts(ck: Checkpoint, ex: str, n: int) -> list:
    """(part, (dtype, columns) of gate / up, (dtype, columns) of down) of every expert's
    stored parts, the same for all: unquantized, FP8 with per-channel scales, or int4
    weight-only with symmetric channel or group scales (vLLM's FusedMoE ``w13_weight``
    / ``w13_weight_scale``, ``w13_weight_packed`` / ``w13_weight_scale`` /
    ``w13_weight_shape``, ...). Other schemes are refused."""
    first = None
    for e in range(n):
        got = []
        for m in ("gate_proj", "up_proj", "down_proj"):
            meta = ck.meta(f"{ex}.{e}.{m}.weight")
            enc, extra = meta.encoding, (meta.quant.extra if meta.quant else {})
            ok = (
                enc == "plain"
                or (enc == "float-quantized" and extra.get("strategy") == "channel")
                or (
                    enc == "pack-quantized"
                    and meta.quant.num_bits == 4  # (vLLM's WNA16 MoE: int4 or int8)
                    and "weight_zero_point" not in meta.parts
                )
            )
            if not ok:
                raise ConfigError(
                    f"'{ex}.{e}.{m}' is {enc} ({extra.get('strategy')}): vLLM's FusedMoE "
                    f"parameters are written for bf16 / fp16, FP8-channel and symmetric "
                    f"int4 weight-only experts for now (docs/vllm-target.md)."
                )
            got.append({k: (p.dtype, p.shape[1] if len(p.shape) > 1 else 0)
                        for k, p in meta.parts.items()})  # fmt: skip
        if got[0] != got[1] or list(got[0]) != list(got[2]):
            raise ConfigError(f"'{ex}.{e}': gate, up and down are stored differently.")
        sig = [(k, got[0][k], got[2][k]) for k in got[0]]
        if first is not None and sig != first:
            raise ConfigError(f"'{ex}.{e}' is stored differently from expert 0.")
        first = sig
    return first


__all__ = ["fused_moe", "local_experts"]
