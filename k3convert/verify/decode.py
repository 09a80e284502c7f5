"""verify's decode check: the candidate decodes greedily with its KV cache, one token at a
time, and must give what its own full forward gives (bit for bit where the float ops are
the same sequence; within a KL bound with an FP8 cache or dynamic activation scales)."""

from __future__ import annotations

import torch

from ..runtime.cache import KVCache
from ..runtime.parallel import ParallelRuntime
from . import metrics as vm

#: decode check where bit-exactness cannot hold (FP8 KV cache, dynamic activation
#: scales): mean KL(full forward || incremental decode) limit
FP8_KV_MAX_KLD = 0.05


def special_tokens(ids: torch.Tensor, avoid: set) -> torch.Tensor:
    m = torch.zeros_like(ids, dtype=torch.bool)
    for t in avoid:
        m |= ids == t
    return m


def _kv_cache_scales(cand: ParallelRuntime, mla_cache: str) -> dict | None:
    """``{layer: {kind: scale}}`` for :class:`KVCache` from the candidate's k_scale /
    v_scale (read from the first rank of the layer's stage; the scales are replicated):
    GQA layers cache K / V; MLA layers only in the latent layout (the expanded layout
    caches kv_b_proj's outputs, which no calibrated scale describes); KDA layers none.
    None when the candidate has no kv_cache_scheme or its quantization is off."""
    if not cand.kv_quant:
        return None
    out: dict[int, dict[str, float]] = {}
    for i in range(cand.num_layers):
        kind = cand.text.attention_of(i)
        if kind == "kda" or (kind == "mla" and mla_cache != "latent"):
            continue
        unit = f"layer.{i}"
        reader = cand.ranks.rank(cand.ranks.tp_group(cand.stage_of[unit])[0])
        entries = cand.plan.units[unit]

        def value(k: str, reader=reader, entries=entries) -> float:
            name = entries[f"attention.{k}_scale"].name
            return float(reader.get(name, torch.float32).reshape(-1)[0])

        k = value("k")
        out[i] = {"k": k, "v": value("v")} if kind == "gqa" else {"latent": k, "k_rot": k}
    return out or None


def decode_check(cand, ids, mask, pv, grid, n, kv_cache, mla_cache, avoid) -> dict:
    """Greedy decode of ``n`` tokens with a KV cache, against full forwards. An FP8 cache
    of a candidate with calibrated KV-cache scales stores with those scales (what a
    serving engine loads), where they describe what the cache holds."""
    scales = _kv_cache_scales(cand, mla_cache) if kv_cache == "fp8" else None
    cache = KVCache(mla=mla_cache, kv_dtype=kv_cache, scales=scales)
    prompt_note = None
    if mask is not None:
        # right-padded rows would continue after their padding: decode from the longest
        # prefix every row really has (when that keeps the images' tokens)
        lens = mask.long().sum(-1)
        prefix = bool((mask.bool() == (torch.arange(mask.shape[1]) < lens[:, None])).all())
        cut = int(lens.min())
        keeps_images = not avoid or bool((special_tokens(ids[:, cut:], avoid) == 0).all())
        if prefix and cut >= 1 and (pv is None or keeps_images):
            ids, mask = ids[:, :cut], None
            prompt_note = f"prompts cut to the {cut} tokens every row has (right padding)"
    b = ids.shape[0]
    ones = torch.ones(b, 1, dtype=torch.long, device=ids.device)
    full_mask = mask
    step_logits = [cand.forward(ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                                cache=cache)[:, -1:]]  # fmt: skip
    seq = ids
    special = sorted(avoid)
    for _ in range(n - 1):
        nxt = step_logits[-1][:, -1]
        if special:  # greedy, but never an image / video placeholder (it needs pixels)
            nxt = nxt.clone()
            nxt[:, special] = float("-inf")
        tok = nxt.argmax(-1, keepdim=True)
        seq = torch.cat((seq, tok.to(seq.device)), dim=1)
        if full_mask is not None:
            full_mask = torch.cat((full_mask, ones), dim=1)
        step_logits.append(cand.forward(tok, attention_mask=full_mask, cache=cache))
    inc = torch.cat(step_logits, dim=1)  # [B, n, V]
    full = cand.forward(seq, attention_mask=full_mask, pixel_values=pv, image_grid_thw=grid)
    full = full[:, ids.shape[1] - 1 :]
    err = float(((inc - full).abs().max() / full.abs().max().clamp_min(1e-30)).item())
    same = bool((inc.argmax(-1) == full.argmax(-1)).all())
    out = {"steps": n, "kv_cache": cache.describe(cand.text.attention), "max_rel_err": err,
           "argmax_equal": same,
           # every rank's cache when simulated; this process's ranks under torchrun
           "cache_mib_this_process": round(cache.nbytes() / 2**20, 3)}  # fmt: skip
    if scales:
        out["kv_scales"] = f"calibrated, from the candidate ({len(scales)} layers)"
    if prompt_note:
        out["prompt"] = prompt_note
    # activation specs that run (routed experts' only with act_quant_experts)
    specs = {
        n: sp for n, sp in cand.act_specs.items()
        if cand.act_quant and (cand.act_quant_experts or n not in cand.routed_weights)
    }  # fmt: skip
    dynamic = any(sp.dynamic for sp in specs.values())
    latent_kvb = mla_cache == "latent" and any("kv_b_proj" in n for n in specs)
    if kv_cache == "fp8" or dynamic or latent_kvb:
        # not bit-for-bit: an e4m3 cache rounds K / V; dynamic activation scales depend
        # on the chunk a Linear sees (MLA's kv_b_proj takes one scale per sequence, as
        # transformers feeds it), so a one-token step quantizes differently; the latent
        # cache absorbs kv_b_proj as a weight, without its input quantization
        why = (
            "an FP8 KV cache" if kv_cache == "fp8"
            else "dynamic activation quantization" if dynamic
            else "the latent MLA cache (kv_b_proj's input quantization is absorbed away)"
        )  # fmt: skip
        kld = vm.compare_logits(full, inc)["kld"]
        out["kld_vs_full"] = kld["mean"]
        out["kld_vs_full_max"] = kld["max"]
        out["compared_by"] = f"mean KLD (not bit-exact with {why})"
        ok = bool(kld["mean"] is not None and kld["mean"] <= FP8_KV_MAX_KLD)
        out["passed"] = ok
        out["failure"] = None if ok else (
            f"decode with {why}: mean KLD {kld['mean']:.3g} vs the full forward exceeds "
            f"{FP8_KV_MAX_KLD}"
        )  # fmt: skip
    else:
        limit = 1e-5 if cand.dtype == torch.float32 else 2e-2
        ok = same and err <= limit
        out["passed"] = ok
        out["failure"] = None if ok else (
            f"incremental decode differs from the full forward: max rel err {err:.3g} "
            f"(limit {limit:g}), argmax {'equal' if same else 'differs'}"
        )  # fmt: skip
    return out
