"""Parity metrics of candidate vs reference logits / hidden states, and pass thresholds.

Everything is computed in float64 a few positions at a time, so a [B, S, 163840] vocab
never needs a float64 copy of the whole tensor, and the results are plain JSON-able
Python values (finite floats or None) that the report can store as they are.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, NonFiniteError

# One float64 chunk of logits holds at most this many values (32 MiB): 25 positions of a
# 163840 vocab, capped at MAX_CHUNK positions for small vocabularies.
CHUNK_ELEMENTS = 1 << 22
MAX_CHUNK = 64
#: logit lead (nats) of the reference's top token over its second that makes a position
#: decisive: the top token is at least e^0.5 = 1.65x as likely as any other
DECISIVE_MARGIN = 0.5
IGNORE_INDEX = -100


# -- logits ---------------------------------------------------------------------------
def compare_logits(
    ref: torch.Tensor,
    cand: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    per_position: bool = False,
    chunk: int | None = None,
) -> dict[str, Any]:
    """Compare candidate logits with the reference's at the selected positions.

    ref, cand: logits [B, S, V] (any float dtype; computed in float64). mask: [B, S],
    nonzero = a real token whose logits count (None = every position). targets: [B, S]
    next-token ids for perplexity, ``-100`` = ignored (the caller shifts; see
    ``inputs.next_token_targets``). per_position: also return ``kld_per_position`` (one
    float per selected position, in order). chunk: positions per float64 chunk (None =
    as many as fit in 2**22 values, at most 64).

    Returns a JSON-able dict:

    - ``positions``: selected positions; ``nonfinite_positions``: those where the
      candidate has a NaN/inf logit (then every error metric is None: unbounded).
    - ``max_abs_err``: max |cand - ref|.
    - ``max_rel_err``: max |cand - ref| / max |ref| - relative to the reference's largest
      magnitude over all selected logits, not elementwise (logits near 0 would make an
      elementwise ratio meaningless). 0.0 when both are all zero, None when only ref is.
    - ``rel_l2``: ||cand - ref|| / ||ref|| over all selected values (same zero rule).
    - ``cosine``: mean over positions of the cosine similarity of the two logit vectors
      (1.0 where both vectors are zero, 0.0 where only one is).
    - ``kld``: {mean, median, p90, p99, p99_9, max} of KL(ref || cand) in nats per
      position, from float64 log_softmax; percentiles as ``numpy.percentile`` (linear).
      Rounding may make a KL slightly negative; it is clamped to 0.0, so identical
      logits give exactly 0.0.
    - ``top1``: fraction of positions where the argmax agrees; ``top1_mismatches``.
    - ``decisive_positions``: positions where the reference's top logit leads its second
      by at least :data:`DECISIVE_MARGIN`; ``top1_decisive``: the argmax agreement there
      (None when there are none). Where the reference hesitates between two tokens a
      flip of its argmax says nothing about the candidate (a random model's near-flat
      logits flip at the slightest rounding); where it leads, a flip is a real error.
    - with targets: ``ppl_ref``, ``ppl_cand`` (exp of the mean NLL of the target ids),
      ``ppl_ratio`` (cand / ref) and ``ppl_tokens`` (positions with a target; the
      ``ppl_*`` values are None when there are none, or on overflow).
    """
    b, s, v = _check_logits(ref, cand)
    sel = _selection(mask, (b, s), "mask")
    tgt = None
    if targets is not None:
        tgt = _targets(targets, (b, s), v)
    idx = sel.nonzero().squeeze(-1)
    n = int(idx.numel())
    if n == 0:
        raise ConfigError("compare_logits: the mask selects no position; nothing to compare.")
    if chunk is None:
        chunk = max(1, min(MAX_CHUNK, CHUNK_ELEMENTS // max(v, 1)))
    if not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"compare_logits: chunk must be a positive integer, got {chunk!r}.")

    ref2, cand2 = ref.reshape(-1, v), cand.reshape(-1, v)
    tgt_flat = tgt.reshape(-1) if tgt is not None else None
    max_abs = ref_max = sq_diff = sq_ref = cos_sum = 0.0
    agree = nonfinite = ppl_tokens = decisive = agree_decisive = 0
    nll_ref = nll_cand = 0.0
    klds: list[torch.Tensor] = []
    for start in range(0, n, chunk):
        ix = idx[start : start + chunk]
        r = ref2.index_select(0, ix.to(ref2.device)).to(torch.float64)
        c = cand2.index_select(0, ix.to(cand2.device)).to(r.device, torch.float64)
        if not bool(torch.isfinite(r).all()):
            bad = int(ix[(~torch.isfinite(r)).any(-1).nonzero()[0, 0]])
            raise NonFiniteError(
                f"reference logits are NaN/inf at batch {bad // s}, position {bad % s}; "
                f"the reference must be finite to judge the candidate."
            )
        finite = torch.isfinite(c).all(-1)  # on r's device, like everything below
        nonfinite += int((~finite).sum())
        same = (r.argmax(-1) == c.argmax(-1)) & finite
        agree += int(same.sum())
        sure = _decisive(r)
        decisive += int(sure.sum())
        agree_decisive += int((same & sure).sum())

        diff = c - r
        max_abs = max(max_abs, float(diff.abs().max()))
        ref_max = max(ref_max, float(r.abs().max()))
        sq_diff += float(diff.square().sum())
        sq_ref += float(r.square().sum())
        del diff
        cos_sum += float(_cosine_rows(r, c).sum())

        lr = torch.log_softmax(r, dim=-1)
        del r
        lc = torch.log_softmax(c, dim=-1)
        del c
        klds.append((lr.exp() * (lr - lc)).sum(-1).clamp_min(0.0).cpu())
        if tgt_flat is not None:
            dr, dc, dn = _nll(lr, lc, tgt_flat.index_select(0, ix).to(lr.device))
            nll_ref, nll_cand, ppl_tokens = nll_ref + dr, nll_cand + dc, ppl_tokens + dn
        del lr, lc

    kld = torch.cat(klds).numpy()
    bad = nonfinite > 0
    out: dict[str, Any] = {
        "positions": n,
        "nonfinite_positions": nonfinite,
        "max_abs_err": None if bad else _finite(max_abs),
        "max_rel_err": None if bad else _ratio(max_abs, ref_max),
        "rel_l2": None if bad else _ratio(math.sqrt(sq_diff), math.sqrt(sq_ref)),
        "cosine": None if bad else _finite(cos_sum / n),
        "kld": _kld_summary(kld, bad),
        "top1": agree / n,
        "top1_mismatches": n - agree,
        "decisive_positions": decisive,
        "top1_decisive": agree_decisive / decisive if decisive else None,
    }
    if tgt is not None:
        out.update(_ppl(nll_ref, nll_cand, ppl_tokens, bad))
    if per_position:
        out["kld_per_position"] = [_finite(float(x)) for x in kld]
    return out


def _decisive(r: torch.Tensor) -> torch.Tensor:
    """[N] bool: the reference's top logit leads its second by DECISIVE_MARGIN (one
    token: nothing to hesitate between)."""
    if r.shape[-1] < 2:
        return torch.ones(r.shape[0], dtype=torch.bool, device=r.device)
    top2 = r.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) >= DECISIVE_MARGIN


def _nll(lr: torch.Tensor, lc: torch.Tensor, t: torch.Tensor) -> tuple[float, float, int]:
    """Summed NLL of the target ids under the reference and the candidate, and how many
    positions have a target (``IGNORE_INDEX`` = none)."""
    keep = t != IGNORE_INDEX
    if not bool(keep.any()):
        return 0.0, 0.0, 0
    tk = t[keep].unsqueeze(-1)
    return (-float(lr[keep].gather(-1, tk).sum()), -float(lc[keep].gather(-1, tk).sum()),
            int(keep.sum()))  # fmt: skip


def _check_logits(ref: Any, cand: Any) -> tuple[int, int, int]:
    for name, t in (("ref", ref), ("cand", cand)):
        if not isinstance(t, torch.Tensor) or t.ndim != 3 or not t.dtype.is_floating_point:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
            raise ConfigError(f"compare_logits: {name} must be float logits [B, S, V], got {got}.")
    if ref.shape != cand.shape:
        raise ConfigError(
            f"compare_logits: candidate logits {tuple(cand.shape)} do not match the "
            f"reference's {tuple(ref.shape)} (a different vocab size or input?)."
        )
    if ref.numel() == 0:
        raise ConfigError(f"compare_logits: logits {tuple(ref.shape)} are empty.")
    b, s, v = ref.shape
    return b, s, v


def _selection(mask: torch.Tensor | None, shape: tuple[int, int], what: str) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape[0] * shape[1], dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConfigError(f"compare_logits: {what} must be [B, S] = {list(shape)}, got {got}.")
    return (mask != 0).reshape(-1).cpu()


def _targets(targets: Any, shape: tuple[int, int], vocab: int) -> torch.Tensor:
    if (
        not isinstance(targets, torch.Tensor)
        or tuple(targets.shape) != shape
        or targets.dtype.is_floating_point
        or targets.dtype == torch.bool
    ):
        got = (
            f"{targets.dtype} {tuple(targets.shape)}"
            if isinstance(targets, torch.Tensor)
            else type(targets).__name__
        )
        raise ConfigError(
            f"compare_logits: targets must be integer [B, S] = {list(shape)}, got {got}."
        )
    t = targets.to(torch.int64).cpu()
    bad = (t != IGNORE_INDEX) & ((t < 0) | (t >= vocab))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ConfigError(
            f"compare_logits: target id {int(t[i, j])} at batch {i}, position {j} is not in "
            f"[0, {vocab}) and not {IGNORE_INDEX} (ignored)."
        )
    return t


def _cosine_rows(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # dot / sqrt(|r|² |c|²): exactly 1.0 for identical rows (sqrt(x * x) == x in IEEE)
    nr, nc = r.square().sum(-1), c.square().sum(-1)
    cos = (r * c).sum(-1) / (nr * nc).sqrt()
    cos = torch.where((nr == 0) & (nc == 0), 1.0, cos)
    cos = torch.where((nr == 0) ^ (nc == 0), 0.0, cos)
    return cos.clamp(-1.0, 1.0)


def _kld_summary(kld: np.ndarray, bad: bool) -> dict[str, float | None]:
    keys = ("mean", "median", "p90", "p99", "p99_9", "max")
    if bad:
        return dict.fromkeys(keys)
    pct = np.percentile(kld, [50.0, 90.0, 99.0, 99.9])
    vals = (kld.mean(), *pct, kld.max())
    return {k: _finite(float(x)) for k, x in zip(keys, vals, strict=True)}


def _ppl(nll_ref: float, nll_cand: float, tokens: int, bad: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"ppl_tokens": tokens, "ppl_ref": None, "ppl_cand": None}
    out["ppl_ratio"] = None
    if tokens == 0:
        return out
    mr, mc = nll_ref / tokens, nll_cand / tokens
    out["ppl_ref"] = _exp(mr)
    if not bad:
        out["ppl_cand"] = _exp(mc)
        out["ppl_ratio"] = _exp(mc - mr)
    return out


def _exp(x: float) -> float | None:
    try:
        return _finite(math.exp(x))
    except OverflowError:
        return None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ratio(num: float, den: float) -> float | None:
    if num == 0.0:
        return 0.0
    if den == 0.0:
        return None
    return _finite(num / den)


# -- hidden states --------------------------------------------------------------------
def rel_l2(ref: torch.Tensor, cand: torch.Tensor) -> float:
    """||cand - ref|| / ||ref|| of two same-shape tensors (hidden states), in float64.

    0.0 when they are equal (both zero included); ``math.inf`` when the reference is
    zero but the candidate is not, or the candidate has a NaN/inf (an unbounded error:
    a report stores it as None). Sums of squares in float64 cannot overflow for float32
    or bf16 inputs. A non-finite reference raises NonFiniteError.
    """
    if not isinstance(ref, torch.Tensor) or not isinstance(cand, torch.Tensor):
        raise ConfigError("rel_l2: ref and cand must be tensors.")
    if ref.shape != cand.shape:
        raise ConfigError(
            f"rel_l2: candidate {tuple(cand.shape)} does not match reference {tuple(ref.shape)}."
        )
    r_all, c_all = ref.reshape(-1), cand.reshape(-1)
    num = den = 0.0
    for start in range(0, r_all.numel(), CHUNK_ELEMENTS):
        r = r_all[start : start + CHUNK_ELEMENTS].to(torch.float64)
        c = c_all[start : start + CHUNK_ELEMENTS].to(torch.float64)
        if not bool(torch.isfinite(r).all()):
            raise NonFiniteError("rel_l2: the reference hidden state holds NaN/inf.")
        if not bool(torch.isfinite(c).all()):
            return math.inf
        num += float((c - r).square().sum())
        den += float(r.square().sum())
    if num == 0.0:
        return 0.0
    if den == 0.0:
        return math.inf
    return math.sqrt(num) / math.sqrt(den)


# -- thresholds -----------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """Limits a candidate must meet; None = not checked.

    max_kld: mean KL(ref || cand) per position, nats. min_top1: fraction of positions
    whose argmax agrees. max_rel_err: ``max_rel_err`` of compare_logits (max abs error
    relative to the reference's largest logit). kind: where the numbers come from.
    """

    max_kld: float | None
    min_top1: float | None
    max_rel_err: float | None
    kind: str = "custom"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Loosest last. "exact": an unquantized resharding only reorders float reductions, so the
# logits agree to float32 rounding. Quantized families: mean KLD / top-1 agreement that a
# healthy quantization of a real model meets with margin on a few hundred tokens (fp8 and
# int8 ~1e-3 nats on released checkpoints, int4 group-128 ~1e-2), while a broken one
# (wrong scales, swapped shards, a missed layer) lands orders of magnitude above. int8 is
# tighter than fp8: 8-bit integers with per-channel scales keep more mantissa than e4m3.
#
# The FP4 families are scaled from int4's by their rounding error. To first order the
# KLD grows with the square of the logits' perturbation, so with the relative RMS weight
# error e (||dequant(q(w)) - w|| / ||w||, measured with these schemes on 1024 x 2048
# Gaussian / Laplace / Student-t(4) weights) a family's limit is int4's x (e / e_int4)^2:
#   int4 g128 (w4a16)   e = 0.111 / 0.151 / 0.183  (a uniform grid: tails cost range)
#   NVFP4 (E2M1 in 16-value groups, FP8 e4m3 scales, fp32 global scale)
#                       e = 0.095 / 0.093 / 0.092  -> (0.095 / 0.111)^2 = 0.73 -> 0.035
#   MXFP4 (E2M1 in 32-value groups, power-of-two E8M0 scales: up to 2x of range lost)
#                       e = 0.112 / 0.124 / 0.129  -> (0.112 / 0.111)^2 = 1.02 -> 0.05
#   NVFP4 W4A4 ("nvfp4"): every Linear's input is rounded as coarsely as its weights,
#                       2 x 0.095^2 / 0.111^2 = 1.47 -> 0.07, top-1 between int4 and int3
# (on a tiny llama, mean KLD vs w4a16's: nvfp4a16 0.75x, mxfp4 0.95x, nvfp4 1.24x).
FAMILIES: dict[str, Thresholds] = {
    "exact": Thresholds(max_kld=1e-6, min_top1=1.0, max_rel_err=1e-5, kind="exact"),
    "int8": Thresholds(max_kld=0.005, min_top1=0.95, max_rel_err=None, kind="int8"),
    "fp8": Thresholds(max_kld=0.01, min_top1=0.9, max_rel_err=None, kind="fp8"),
    "nvfp4a16": Thresholds(max_kld=0.035, min_top1=0.8, max_rel_err=None, kind="nvfp4a16"),
    "mxfp4": Thresholds(max_kld=0.05, min_top1=0.8, max_rel_err=None, kind="mxfp4"),
    "int4": Thresholds(max_kld=0.05, min_top1=0.8, max_rel_err=None, kind="int4"),
    "nvfp4": Thresholds(max_kld=0.07, min_top1=0.75, max_rel_err=None, kind="nvfp4"),
    "int3": Thresholds(max_kld=0.2, min_top1=0.6, max_rel_err=None, kind="int3"),
    "int2": Thresholds(max_kld=1.0, min_top1=0.3, max_rel_err=None, kind="int2"),
}
_ORDER = list(FAMILIES)

#: what each family covers, in words (the report names the family with it)
FAMILY_ABOUT: dict[str, str] = {
    "exact": "resharding of the same weights, fp32",
    "resharding-bf16": "resharding computed in bf16",
    "resharding-fp16": "resharding computed in fp16",
    "int8": "8-bit integer weights / activations",
    "fp8": "FP8 e4m3 weights / activations",
    "nvfp4a16": "NVFP4 weights, 16-bit activations",
    "mxfp4": "MXFP4 weights",
    "int4": "4-bit integer weights",
    "nvfp4": "NVFP4 weights and activations",
    "int3": "3-bit integer weights",
    "int2": "1-2-bit integer weights",
}

_ALIASES: list[tuple[str, str]] = [
    (r"exact|none|plain", "exact"),
    (r"fp8(-.*)?", "fp8"),
    (r"mxfp4a16", "mxfp4"),
    (r"int8(-.*)?", "int8"),
]


def default_thresholds(kind: str) -> Thresholds:
    """Thresholds of a family or scheme name.

    Families: "exact" (unquantized resharding), "fp8", "int8", "int4", "int3", "int2".
    A registered scheme's name takes the family the scheme declares
    (``Scheme.support.verify_family``); other names map to the loosest family of their
    weights and activations by their spelling: fp8 /
    fp8-block / fp8-dynamic / fp8-* -> fp8; int8-* and wNaM by N-bit int weights and
    M-bit activations (int, or fp8 for a "-fp8" suffix; 16 = not quantized): w8a8 /
    w8a8-g128 -> int8, w4a16 / w4a16-asym / w4a8-fp8 -> int4, w3a16 -> int3;
    intN-gG[-asym] -> intN. N = 5..7 bits -> int4 (the nearest looser family), 1 -> int2.
    The FP4 schemes have their own families: nvfp4a16, mxfp4 and nvfp4 (W4A4).
    """
    if not isinstance(kind, str):
        raise ConfigError(f"thresholds: kind must be a string, got {type(kind).__name__}.")
    k = kind.strip().lower()
    if k in FAMILIES:
        return FAMILIES[k]
    from ..quant.schemes import get_scheme, known_schemes  # (torch; verify may not need it)

    if k in known_schemes():  # a registered scheme says its family
        return FAMILIES[get_scheme(k).support.verify_family]
    for pattern, family in _ALIASES:
        if re.fullmatch(pattern, k):
            return FAMILIES[family]
    m = re.fullmatch(r"int(\d{1,2})(-.*)?", k)
    if m and 1 <= int(m.group(1)) <= 16:
        return FAMILIES[_int_family(int(m.group(1)))]
    m = re.fullmatch(r"w(\d{1,2})a(\d{1,2})(-.*)?", k)
    if m and all(1 <= int(x) <= 16 for x in m.group(1, 2)):
        act_bits, rest = int(m.group(2)), m.group(3) or ""
        act = "fp8" if act_bits == 8 and "fp8" in rest else _int_family(act_bits)
        return FAMILIES[max(_int_family(int(m.group(1))), act, key=_ORDER.index)]
    raise ConfigError(
        f"thresholds: unknown kind {kind[:40]!r}; use one of {', '.join(FAMILIES)} or a "
        f"scheme name (fp8-block, w8a8, w4a16, int4-g128, ...)."
    )


def _int_family(bits: int) -> str:
    if bits >= 16:
        return "exact"
    if bits >= 8:
        return "int8"
    if bits >= 4:
        return "int4"
    return "int3" if bits == 3 else "int2"


def _args_family(args: Any, where: str) -> str:
    """Family of one compressed-tensors QuantizationArgs dict (defaults: 8 bits, int)."""
    if not isinstance(args, dict):
        raise ConfigError(f"config.json: {where} must be an object, got {type(args).__name__}.")
    bits = args.get("num_bits", 8)
    typ = args.get("type", "int")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 64:
        raise ConfigError(f"config.json: {where}.num_bits must be an integer 1..64, got {bits!r}.")
    if typ == "int":
        return _int_family(bits)
    if typ == "float":
        if bits >= 16:
            return "exact"
        if bits == 4:
            return _fp4_family(args, activations=where.endswith("input_activations"))
        return "fp8" if bits == 8 else "int4"  # fp6 is about as coarse as int4
    raise ConfigError(f"config.json: {where}.type must be 'int' or 'float', got {str(typ)[:30]!r}.")


def _fp4_family(args: dict, activations: bool) -> str:
    """FP4 (E2M1) arguments: FP4 inputs are NVFP4 W4A4's regime (every input rounded as
    coarsely as the weights); weights by their scales: FP8 scales / 16-value groups ->
    nvfp4a16, power-of-two (uint8 E8M0) scales / 32-value groups -> mxfp4; another FP4
    layout -> int4 (as coarse)."""
    if activations:
        return "nvfp4"
    scale = str(args.get("scale_dtype") or "").lower()
    group = args.get("group_size")
    if (
        "float8" in scale
        or "e4m3" in scale
        or args.get("strategy") == "tensor_group"
        or (not scale and group == 16)
    ):
        return "nvfp4a16"
    if "uint8" in scale or "e8m0" in scale or (not scale and group == 32):
        return "mxfp4"
    return "int4"


_PRECISION_KEYS = ("num_bits", "type", "strategy", "group_size", "block_structure",
                   "symmetric", "dynamic", "scale_dtype")  # fmt: skip


def _group_spec(g: Any) -> str:
    """A config group's stored precision (weights and input activations): the keys that
    say how values are encoded, not targets nor how the scales were found (observer)."""
    if not isinstance(g, dict):
        return ""
    parts = [
        {k: a.get(k) for k in _PRECISION_KEYS} if isinstance(a, dict) else a
        for a in (g.get("weights"), g.get("input_activations"))
    ]
    return json.dumps(parts, sort_keys=True)


def _quant_configs(config: dict) -> list[tuple[Any, str]]:
    found: list[tuple[Any, str]] = []
    scopes: list[tuple[dict, str]] = [(config, "")]
    if isinstance(config.get("text_config"), dict):
        scopes.append((config["text_config"], "text_config."))
    for scope, prefix in scopes:
        for key in ("quantization_config", "compression_config"):
            if scope.get(key) is not None:
                found.append((scope[key], prefix + key))
    return found


def _qc_families(qc: Any, where: str, carried: frozenset[str] = frozenset()) -> list[str]:
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json: {where} must be an object, got {type(qc).__name__}.")
    method = qc.get("quant_method", "compressed-tensors")
    out: list[str] = []
    if "config_groups" in qc or method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ConfigError(f"config.json: {where}.config_groups must be an object.")
        for gname, g in groups.items():
            if not isinstance(g, dict):
                raise ConfigError(f"config.json: {where}.config_groups.{gname} must be an object.")
            if _group_spec(g) in carried:
                continue  # the reference's own encoding, carried over (MXFP4 as released)
            for key in ("weights", "input_activations"):
                if g.get(key) is not None:
                    out.append(_args_family(g[key], f"{where}.config_groups.{gname}.{key}"))
        if qc.get("kv_cache_scheme") is not None:
            out.append(_args_family(qc["kv_cache_scheme"], f"{where}.kv_cache_scheme"))
        return out
    if method == "fp8":  # DeepSeek-V3's native block fp8
        return ["fp8"]
    bits = qc.get("bits")  # gptq / awq style
    if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 64:
        return [_int_family(bits)]
    raise ConfigError(
        f"config.json: {where} has quant_method {str(method)[:40]!r}, whose precision "
        f"k3convert cannot tell; choose the thresholds explicitly."
    )


def thresholds_for_quant_config(config: dict, reference: dict | None = None) -> Thresholds:
    """Thresholds for a candidate whose config.json dict is ``config``.

    Reads ``quantization_config`` (or ``compression_config``) at the top level and in
    ``text_config`` (kimi_k25 keeps it in either) and takes the loosest family of every
    config group's ``weights`` and ``input_activations`` ({num_bits, type}) and of the
    ``kv_cache_scheme``: int 8 bits -> int8, float 8 -> fp8, int 4..7 / float 5..6 ->
    int4, int 3 -> int3, int 1..2 -> int2; float 4 (FP4) weights -> nvfp4a16 (FP8 scales,
    16-value groups) or mxfp4 (power-of-two scales, 32-value groups), FP4 input
    activations -> nvfp4 (W4A4). quant_method "fp8" (DeepSeek-V3 native) ->
    fp8; a gptq/awq-style ``bits`` -> its int family. No quantization_config -> "exact".

    This judges a candidate against an UNQUANTIZED reference; when the reference is the
    same quantized checkpoint (a resharding), use ``default_thresholds("exact")``. With
    ``reference`` (its config.json dict), a candidate group of the same precision as one
    of the reference's groups is the release's own encoding carried over (Kimi K3's MXFP4
    experts kept as released) and sets no family: only what the conversion changed does.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"config.json must be an object, got {type(config).__name__}.")
    carried = frozenset(
        _group_spec(g)
        for qc, _ in (_quant_configs(reference) if isinstance(reference, dict) else [])
        if isinstance(qc, dict) and isinstance(qc.get("config_groups"), dict)
        for g in qc["config_groups"].values()
    )
    families = ["exact"]
    for qc, where in _quant_configs(config):
        families += _qc_families(qc, where, carried)
    return FAMILIES[max(families, key=_ORDER.index)]


# -- pass / fail ----------------------------------------------------------------------
def limit_checks(metrics: dict[str, Any], th: Thresholds) -> list[dict[str, Any]]:
    """One row per limit that ``th`` sets: {metric, value, op, limit, passed}.

    kld.mean <= max_kld, top1 >= min_top1, max_rel_err <= max_rel_err; a None
    (non-finite) value fails. Shared by ``check`` and the report table. Top-1 is judged
    on compare_logits' decisive positions (``top1_decisive``; not at all when there are
    none), on ``top1`` for metrics that do not have them.
    """
    kld = metrics.get("kld") or {}
    top1 = ("top1", metrics.get("top1"))
    if "decisive_positions" in metrics:  # compare_logits' own metrics: judged where it means
        top1 = ("top1_decisive", metrics.get("top1_decisive"))
    rows = []
    for metric, value, op, limit, name in (
        ("kld.mean", kld.get("mean"), "<=", th.max_kld, "max_kld"),
        (*top1, ">=", th.min_top1, "min_top1"),
        ("max_rel_err", metrics.get("max_rel_err"), "<=", th.max_rel_err, "max_rel_err"),
    ):
        if limit is None or (metric == "top1_decisive" and not metrics["decisive_positions"]):
            continue  # (no decisive position: top-1 says nothing, the KLD judges alone)
        ok = (
            value is not None
            and math.isfinite(value)
            and (value <= limit if op == "<=" else value >= limit)
        )
        rows.append(
            {"metric": metric, "value": value, "op": op, "limit": limit, "name": name, "passed": ok}
        )
    return rows


def check(
    report_metrics: dict[str, Any], th: Thresholds, layers: list[dict] | None = None
) -> tuple[bool, str | None]:
    """(passed, the first failure's message) of compare_logits' metrics against ``th``.

    Order: non-finite candidate logits, then kld.mean, top1, max_rel_err. The message
    names the metric, its value and the limit. With ``layers`` ([{"layer": name,
    "rel_l2": x}, ...] in forward order) a failure also names the layer
    ``locate_divergence`` picks (its quantized rule unless ``th.kind`` is exact).
    """
    msg = None
    nf = report_metrics.get("nonfinite_positions") or 0
    if nf:
        msg = (
            f"candidate logits are NaN/inf at {nf} of {report_metrics.get('positions')} position(s)"
        )
    else:
        for row in limit_checks(report_metrics, th):
            if row["passed"]:
                continue
            v = row["value"]
            if v is None or not math.isfinite(v):
                msg = f"{row['metric']} is not finite (limit {row['name']} {row['limit']:g})"
            else:
                bad_op = ">" if row["op"] == "<=" else "<"
                msg = f"{row['metric']} = {v:.6g} {bad_op} {row['name']} {row['limit']:g}"
            break
    if msg is None:
        return True, None
    if layers:
        where = _divergence_text(layers, quantized=not th.kind.startswith("exact"))
        if where:
            msg += f"; {where}"
    return False, msg


def _err(x: Any) -> float:
    """A layer's rel_l2 as a comparable float: None / NaN count as an infinite error."""
    if x is None:
        return math.inf
    x = float(x)
    return math.inf if math.isnan(x) else x


JUMP_FLOOR = 1e-6
JUMP_FACTOR = 10.0


def locate_divergence(layers: list[dict], quantized: bool = False) -> tuple[int, bool] | None:
    """(index, by_rule) of the layer where the hidden-state error starts, or None.

    Rule: the first layer whose rel_l2 exceeds ``max(1e-6, 10 × the error before it)``
    (the error before the first entry is 0, since both models see the same ids);
    by_rule = True. quantized: the first layer's error is the quantization's own (every
    layer has one), so the rule starts at the second layer, against the first. If no
    layer qualifies: the layer with the largest increase over the one before it
    (absolute; quantized: relative, from the second layer on); by_rule = False. None
    when the list is empty or no error ever grows. None / NaN / inf count as infinite.
    """
    errs = [_err(e.get("rel_l2")) for e in layers]
    start = 1 if quantized and len(errs) > 1 else 0
    prev = errs[start - 1] if start else 0.0
    for i in range(start, len(errs)):
        x = errs[i]
        if x > max(JUMP_FLOOR, JUMP_FACTOR * prev):
            return i, True
        prev = x
    best, best_inc = None, 0.0
    prev = errs[start - 1] if start else 0.0
    for i in range(start, len(errs)):
        x = errs[i]
        inc = (x / prev if prev > 0 else math.inf) if quantized else x - prev
        if inc > best_inc and x > prev:
            best, best_inc = i, inc
        prev = x
    return None if best is None else (best, False)


def _divergence_text(layers: list[dict], quantized: bool = False) -> str | None:
    hit = locate_divergence(layers, quantized)
    if hit is None:
        return None
    i, by_rule = hit
    name = layers[i].get("layer", i)
    here = _fmt_err(layers[i].get("rel_l2"))
    before = _fmt_err(layers[i - 1].get("rel_l2")) if i > 0 else "0"
    if by_rule:
        lead = "hidden-state error first exceeds max(1e-6, 10× the error before it)"
        if quantized:
            lead += " (from the second layer on; the first layer's is the quantization's own)"
    elif quantized:
        lead = "no layer's error jumps 10× over the one before it; the largest relative jump is"
    else:
        lead = "no layer's error exceeds max(1e-6, 10× the one before it); the largest increase is"
    return f"{lead} at layer {name!r} (#{i}: rel_l2 {here}, before it {before})"


def _fmt_err(x: Any) -> str:
    e = _err(x)
    return "inf/NaN" if math.isinf(e) else f"{e:.3e}"
