"""Decoder layers of the text families: GQA, MLA or KDA attention, dense MLP or routed MoE.

A family is its :class:`k3convert.arch.Arch` (attention kind, router kind, hybrid), keyed
by the architecture name, so qwen2 / qwen3 / mistral run llama's and mixtral runs
qwen3_moe's. Every setting that the parsed architecture config does not carry (norm eps,
activation, rope, router scoring, rope interleave, sliding window) is read here from the
raw config dict, once, into :class:`TextSettings`.

Hybrid families (``kimi_linear``: transformers' Kimi-Linear; ``kimi_k3``: Kimi K3's text
model, Moonshot's code) mix two attention kinds layer by layer
(``TextSettings.layer_attention``): KDA, a gated delta rule with a fixed-size recurrent
state (:mod:`.kda`), and MLA without rotary (NoPE: the "rope" half of the head is used
unrotated; both references apply no position encoding at all), K3's MLA output gated
by ``sigmoid(g_proj(x))``. K3 adds:

- the ``situ`` gated activation (:class:`~.ops.SiTU`) in every MLP;
- a *latent* MoE: the router scores the full hidden state, the routed experts run on
  ``routed_expert_down_proj(x)``, their weighted sum goes through ``routed_expert_norm``
  and ``routed_expert_up_proj``; shared experts run on x. The weighted sum is taken in
  float32 (Moonshot's ``moe_infer``), and under expert / tensor parallelism it must be
  complete before the norm (:func:`latent_routed`, :func:`latent_finish`);
- attention residuals (``attn_res_block_size``): the state between layers is an
  :class:`AttnResState`, not a tensor (see there).

Shapes: hidden [B, S, H]; per-head tensors [B, heads, S, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..arch.base import Arch, finite, get_arch
from ..errors import ArchError, ConfigError, NonFiniteError
from ..quant.activations import ActivationSpec, fake_quant_activation
from .kda import KDASettings, KDAState, kda_attention
from .ops import activation, attend, rms_norm, situ
from .ops import attention_mask as build_mask
from .rope import Rotary, apply_rope, apply_rope_interleaved, rope_config, yarn_mscale
from .source import Weights

#: linear(weights, key, x) -> y, with bias and hooks (provided by the Runtime)
Linear = Callable[[Weights, str, torch.Tensor], torch.Tensor]

#: eps of MLA's q_a / kv_a RMSNorms: fixed in DeepSeek's reference code, not rms_norm_eps
MLA_LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class TextSettings:
    """Everything a decoder layer needs besides its weights."""

    family: str
    attention: str  # "gqa" | "mla"
    router: str | None  # None | "softmax" | "sigmoid_group"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim; MLA: qk_nope + qk_rope
    rms_eps: float
    act: Callable[[torch.Tensor], torch.Tensor] | None  # None: ``glu`` combines gate and up
    rotary: Rotary | None  # None: no position encoding (NoPE MLA of the hybrid families)
    scale: float
    windows: tuple[int | None, ...]  # sliding window per layer (None: full causal)
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # MoE
    top_k: int = 0
    num_experts: int = 0
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # hybrid families (kimi_linear, kimi_k3)
    layer_attention: tuple[str, ...] = ()  # per layer "kda" | "mla"; (): ``attention``
    kda: Any = None  # kda.KDASettings of the KDA layers
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (gate, up)
    attn_res_block: int | None = None  # attention residuals: a new block every N layers

    def attention_of(self, layer: int) -> str:
        """Attention kind of decoder layer ``layer``: gqa, mla or kda."""
        return self.layer_attention[layer] if self.layer_attention else self.attention


def _family(arch_name: str, where: str) -> Arch:
    """The architecture named ``arch_name`` (its canonical name, not an alias)."""
    try:
        fam = get_arch(arch_name)
    except ArchError:
        fam = None
    if fam is None or fam.name != arch_name:
        raise ConfigError(f"{where}: the runtime has no forward pass for '{arch_name}'.")
    return fam


def _windows(raw: dict, n: int) -> tuple[int | None, ...]:
    sw = raw.get("sliding_window")
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) >= n:
        return tuple(sw if t == "sliding_attention" and sw else None for t in types[:n])
    if raw.get("use_sliding_window") is False:
        return (None,) * n
    return (int(sw) if sw else None,) * n


def text_settings(arch_name: str, cfg: Any, raw: dict, where: str) -> TextSettings:
    """Settings of the decoder; ``raw`` is the text config dict (text_config for kimi_k25)."""
    fam = _family(arch_name, where)
    if fam.hybrid:
        return _hybrid_settings(fam, cfg, raw, where)
    act = activation(raw.get("hidden_act"), where)
    eps = finite(raw.get("rms_norm_eps"), "rms_norm_eps", where, 1e-6)
    windows = _windows(raw, cfg.num_layers)
    common: dict = dict(
        family=arch_name,
        attention=fam.attention,
        router=fam.router,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        rms_eps=eps,
        act=act,
        windows=windows,
    )
    if fam.router is not None:
        common.update(
            top_k=cfg.num_experts_per_tok,
            num_experts=cfg.num_experts,
            norm_topk_prob=cfg.norm_topk_prob,
        )
    if fam.attention == "gqa":
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"{where}: num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}."
            )
        rc = rope_config(raw, cfg.head_dim, where)
        return TextSettings(
            **common,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rotary=Rotary(rc),
            scale=cfg.head_dim**-0.5,
        )
    rc = rope_config(raw, cfg.qk_rope_head_dim, where)
    scale = cfg.qk_head_dim**-0.5
    m_all = rc.get("mscale_all_dim")
    if rc.rope_type != "default" and m_all:
        # DeepSeek folds YaRN's magnitude correction into the softmax scale
        m = yarn_mscale(float(rc.params["factor"]), float(m_all))
        scale = scale * m * m
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        raise ConfigError(
            f"{where}: group-limited routing needs at least 2 experts per group "
            f"(n_routed_experts={cfg.num_experts}, n_group={cfg.n_group})."
        )
    return TextSettings(
        **common,
        num_kv_heads=cfg.num_heads,
        head_dim=cfg.qk_head_dim,
        rotary=Rotary(rc),
        scale=scale,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope=cfg.qk_nope_head_dim,
        qk_rope=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


def _hybrid_settings(fam: Arch, cfg: Any, raw: dict, where: str) -> TextSettings:
    """A KDA / MLA hybrid decoder: kimi_linear as transformers 5.24 runs it, or as
    Moonshot's modeling_kimi_linear does (``Arch.reference``: Kimi K3's text)."""
    arch_name = fam.name
    eps = finite(raw.get("rms_norm_eps"), "rms_norm_eps", where, 1e-6)
    name = raw.get("hidden_act")
    if name == "situ":
        if fam.reference != "moonshot":
            raise ConfigError(f"{where}: hidden_act 'situ' is Kimi K3's; '{arch_name}' has none.")
        glu, act = situ(raw, where), None
    else:
        glu, act = None, activation(name, where)
        if fam.reference == "transformers" and name not in (None, "silu", "swish"):
            # transformers runs the KDA short convolution with hidden_act, the KDA op with SiLU
            raise ConfigError(
                f"{where}: kimi_linear with hidden_act '{name}' is not supported (its KDA "
                f"short convolution would use it); only silu."
            )
    if fam.reference == "moonshot":
        scoring = raw.get("moe_router_activation_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(
                f"{where}: moe_router_activation_func '{scoring}' is not supported; Kimi K3 "
                f"routes with sigmoid scores."
            )
        if not cfg.mla_use_nope and not all(map(cfg.is_kda_layer, range(cfg.num_layers))):
            raise ConfigError(
                f"{where}: mla_use_nope is false; Moonshot's MLA has no rotary embedding "
                f"(it asserts mla_use_nope), so this config has no reference forward pass."
            )
    if cfg.n_group > 1 and cfg.num_experts // cfg.n_group < 2:
        raise ConfigError(
            f"{where}: group-limited routing needs at least 2 experts per group "
            f"(num_experts={cfg.num_experts}, num_expert_group={cfg.n_group})."
        )
    n = cfg.num_layers
    kinds = tuple("kda" if cfg.is_kda_layer(i) else "mla" for i in range(n))
    kda = None
    if "kda" in kinds:
        kda = KDASettings(
            num_heads=cfg.kda_num_heads,
            head_dim=cfg.kda_head_dim,
            conv_kernel=cfg.conv_kernel,
            lower_bound=cfg.gate_lower_bound,
            rms_eps=eps,
        )
    top_k = cfg.num_experts_per_tok
    return TextSettings(
        family=arch_name,
        attention=fam.attention,
        router=fam.router,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_heads,
        head_dim=cfg.qk_head_dim,
        rms_eps=eps,
        act=act,
        rotary=None,
        scale=cfg.qk_head_dim**-0.5,
        windows=(None,) * n,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope=cfg.qk_nope_head_dim,
        qk_rope=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        top_k=top_k,
        num_experts=cfg.num_experts,
        # Moonshot renormalises only when more than one expert is chosen
        norm_topk_prob=cfg.norm_topk_prob and (fam.reference == "transformers" or top_k > 1),
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        layer_attention=kinds,
        kda=kda,
        glu=glu,
        attn_res_block=cfg.attn_res_block_size,
    )


@dataclass
class Step:
    """Per-forward inputs shared by all layers: rope tables and masks.

    With a KV cache the queries are the ``S`` new tokens and the keys are the ``past``
    cached ones plus those: masks are ``[B, 1, S, past + S]``.
    """

    cos: torch.Tensor | None  # [B, S, rope_dim] float32 (None: no rotary)
    sin: torch.Tensor | None
    masks: dict[int | None, torch.Tensor | None]  # window -> [B, 1, S, past+S] bool or None
    past: int = 0
    #: MLA may lay its values out for sdpa's fused kernel (:func:`_flash_values`); off
    #: under activation fake-quantization, where the unfused kernel transformers runs keeps
    #: its rounding: quantizing o_proj's input amplifies any difference to whole fp8 steps
    fused_mla: bool = True
    #: the S new tokens' padding mask [B, S] (1 = token) for KDA layers; None: no padding
    tokens: torch.Tensor | None = None
    #: KV-cache observers ``fn(layer, kind, t)`` (the Runtime's live list, see
    #: :func:`kv_enter`); empty: nothing observed
    kv_hooks: list | tuple = ()
    #: fake-quantize what enters the KV cache with the layer's calibrated FP8 scales
    kv_quant: bool = False


# -- the KV cache's input ------------------------------------------------------------
#: unit keys of a layer's calibrated KV-cache scales (arch.common.kv_scales)
K_SCALE, V_SCALE = "attention.k_scale", "attention.v_scale"
#: the one kv_cache_scheme applied: FP8 e4m3, one static scale per tensor
_KV_SPEC = ActivationSpec(num_bits=8, type="float", strategy="tensor", dynamic=False)


def kv_enter(
    w: Weights, step: Step, layer: int, kind: str, t: torch.Tensor, scale_key: str
) -> torch.Tensor:
    """A tensor entering the KV cache (GQA ``k`` / ``v``; MLA ``latent`` / ``k_rot``):
    shown to the KV hooks as it is, then, with ``step.kv_quant``, fake-quantized to FP8
    e4m3 with the layer's static scale, ``clamp(t / s, -448, 448) -> e4m3 -> * s``, in
    t's dtype (compressed-tensors' ``forward_quantize`` of a static per-tensor scale).
    Called in the cache and the no-cache paths alike; callers skip it when both
    ``step.kv_hooks`` and ``step.kv_quant`` are off."""
    for fn in step.kv_hooks:
        fn(layer, kind, t)
    if not step.kv_quant:
        return t
    return fake_quant_kv(t, w.need(scale_key), w.names.get(scale_key, scale_key))


def fake_quant_kv(t: torch.Tensor, scale: torch.Tensor, name: str = "k_scale") -> torch.Tensor:
    """FP8 quantize-dequantize of ``t`` with a static per-tensor ``scale`` ([1])."""
    s = scale.reshape(-1)
    if s.numel() != 1 or not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise NonFiniteError(
            f"KV-cache scale '{name}' is {s.tolist()}; a scale must be one finite positive "
            f"number. The checkpoint's calibration is broken: re-run quantize --kv-cache."
        )
    return fake_quant_activation(t, _KV_SPEC.with_scale(s.to(t.dtype)))


# -- attention -----------------------------------------------------------------------
def gqa_attention(
    ts: TextSettings, lin: Linear, w: Weights, h: torch.Tensor, mask, step: Step, cache=None,
    layer: int = -1,
):  # fmt: skip
    """Head counts come from the weights' shapes, so a tensor-parallel rank's slice (its
    local heads, its KV head) runs the same code. layer: the decoder layer (KV hooks)."""
    b, s, _ = h.shape
    d = ts.head_dim
    q = lin(w, "attention.q_proj", h).view(b, s, -1, d)
    k = lin(w, "attention.k_proj", h).view(b, s, -1, d)
    v = lin(w, "attention.v_proj", h).view(b, s, -1, d)
    if "norms.q_norm" in w:
        q = rms_norm(q, w["norms.q_norm"], ts.rms_eps)
    if "norms.k_norm" in w:
        k = rms_norm(k, w["norms.k_norm"], ts.rms_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = apply_rope(q, step.cos, step.sin)
    k = apply_rope(k, step.cos, step.sin)
    if step.kv_hooks or step.kv_quant:
        k = kv_enter(w, step, layer, "k", k, K_SCALE)
        v = kv_enter(w, step, layer, "v", v, V_SCALE)
    if cache is not None:
        k, v = cache.append("k", k, 2), cache.append("v", v, 2)
    o = attend(q, k, v, mask, ts.scale, causal=True)
    return lin(w, "attention.o_proj", o)


def mla_attention(
    ts: TextSettings, lin: Linear, w: Weights, h: torch.Tensor, mask, step: Step, cache=None,
    layer: int = -1,
):  # fmt: skip
    """MLA; what enters the KV cache (:func:`kv_enter`) is the normed latent and the roped
    shared key, in either cache layout: with an expanded cache (or none) kv_b_proj then
    expands the quantized latent, as a serving engine's latent cache would hand it out.
    Both are quantized with the layer's k_scale (vLLM's MLA stores them as one cache
    entry with one scale)."""
    b, s, _ = h.shape
    if "attention.q_a_proj" in w:
        qa = lin(w, "attention.q_a_proj", h)
        qa = rms_norm(qa, w.need("norms.q_a_layernorm"), MLA_LORA_NORM_EPS)
        q = lin(w, "attention.q_b_proj", qa)
    else:
        q = lin(w, "attention.q_proj", h)
    q = q.view(b, s, -1, ts.qk_nope + ts.qk_rope).transpose(1, 2)  # local heads
    nh = q.shape[1]
    q_nope, q_rot = q.split([ts.qk_nope, ts.qk_rope], dim=-1)
    ckv = lin(w, "attention.kv_a_proj_with_mqa", h)
    latent, k_rot = ckv.split([ts.kv_lora_rank, ts.qk_rope], dim=-1)
    latent = rms_norm(latent, w.need("norms.kv_a_layernorm"), MLA_LORA_NORM_EPS)
    k_rot = k_rot.reshape(b, 1, s, ts.qk_rope)
    if ts.rotary is not None:
        rot = apply_rope_interleaved if ts.rope_interleave else apply_rope
        q_rot = rot(q_rot, step.cos, step.sin)
        k_rot = rot(k_rot, step.cos, step.sin)
    if step.kv_hooks or step.kv_quant:
        latent = kv_enter(w, step, layer, "latent", latent, K_SCALE)
        k_rot = kv_enter(w, step, layer, "k_rot", k_rot, K_SCALE)
    if cache is not None and cache.mla == "latent":
        o = _mla_latent(ts, w, q_nope, q_rot, latent, k_rot, mask, cache)
        return lin(w, "attention.o_proj", _output_gate(lin, w, h, o))
    # transformers feeds kv_b_proj the latent as [B, 1, S, r]; per-token activation
    # quantization then takes one scale per sequence (dims 2.. are reduced), so keep it
    kv = lin(w, "attention.kv_b_proj", latent.view(b, 1, s, ts.kv_lora_rank))
    kv = kv.view(b, s, nh, ts.qk_nope + ts.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([ts.qk_nope, ts.v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_rot), dim=-1)
    k = torch.cat((k_nope, k_rot.expand(b, nh, s, ts.qk_rope)), dim=-1)
    if cache is not None:
        k, v = cache.append("k", k, 2), cache.append("v", v, 2)
    cols = None
    if step.fused_mla:
        v, cols = _flash_values(v, kv if cache is None else None, q.shape[-1])
    o = attend(q, k, v, mask, ts.scale, causal=True, v_cols=cols)
    return lin(w, "attention.o_proj", _output_gate(lin, w, h, o))


def _output_gate(lin: Linear, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """K3's MLA output gate (``mla_use_output_gate``): ``o * sigmoid(g_proj(h))`` with h the
    layer's normed input, o the heads' outputs [B, S, heads * v]; o itself without one."""
    if "attention.g_proj" not in w:
        return o
    return o * torch.sigmoid(lin(w, "attention.g_proj", h))


def _flash_values(v: torch.Tensor, kv: torch.Tensor | None, dq: int):
    """``(values, columns)`` for :func:`attend`: MLA's values (``v_head_dim`` wide) in a
    tensor as wide as the queries, and the columns of the output that are theirs.

    torch's CPU flash-attention kernel needs q, k and v of one head width; MLA's v is
    narrower (64 vs 96 here, 128 vs 192 in DeepSeek-V3), which sends sdpa to its unfused
    math path, ~3x slower at 256 tokens. Output columns are independent weighted sums of
    the value columns, so extra columns change nothing in the real ones: without a cache
    the last ``dq`` columns of ``kv_b_proj``'s per-head output ``[k_nope | v]`` are used
    (a view, no copy; v is its tail); with one, v is zero-padded (one copy). Both give the
    same bits; only flash-vs-math rounding differs from the unfused kernel.
    """
    dv = v.shape[-1]
    if dv > dq:  # wider values than queries: the unfused kernel (q, k would need padding)
        return v, None
    if kv is not None and kv.shape[-1] >= dq:
        return kv[..., kv.shape[-1] - dq :], slice(dq - dv, dq)
    if dv == dq:
        return v, None
    return F.pad(v, (0, dq - dv)), slice(0, dv)


def _mla_latent(ts: TextSettings, w: Weights, q_nope, q_rot, latent, k_rot, mask, cache):
    """MLA over the compressed cache: ``kv_b_proj = [W_uk; W_uv]`` per head is absorbed,
    ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``o = W_uv (p . c)``, so only the
    normed latent ``c`` and the roped key are cached. kv_b_proj runs as a weight here,
    not as a Linear call (no activation quantization or hook for it). Returns the heads'
    outputs [B, S, heads * v] (o_proj's input)."""
    b, nh, s, _ = q_nope.shape
    c = cache.append("latent", latent, 1)  # [B, Skv, r]
    kr = cache.append("k_rot", k_rot[:, 0], 1)  # [B, Skv, rope]
    wkv = w.need("attention.kv_b_proj").view(nh, ts.qk_nope + ts.v_head_dim, ts.kv_lora_rank)
    w_uk, w_uv = wkv.split([ts.qk_nope, ts.v_head_dim], dim=1)
    q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk.to(q_nope.dtype))
    scores = torch.einsum("bhsr,btr->bhst", q_lat, c) + torch.einsum("bhsd,btd->bhst", q_rot, kr)
    scores = scores.float() * ts.scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif s > 1:
        t = c.shape[1]
        causal = torch.ones(s, t, dtype=torch.bool, device=scores.device).tril(t - s)
        scores = scores.masked_fill(~causal, float("-inf"))
    p = scores.softmax(dim=-1).to(c.dtype)
    o_lat = torch.einsum("bhst,btr->bhsr", p, c)
    return torch.einsum("bhsr,hvr->bshv", o_lat, w_uv.to(o_lat.dtype)).reshape(
        b, s, nh * ts.v_head_dim
    )


ATTENTION = {"gqa": gqa_attention, "mla": mla_attention}


# -- MLPs and routing ----------------------------------------------------------------
def gated_mlp(ts: TextSettings, lin: Linear, w: Weights, prefix: str, x: torch.Tensor):
    g = lin(w, f"{prefix}.gate_proj", x)
    u = lin(w, f"{prefix}.up_proj", x)
    if ts.glu is not None:
        return lin(w, f"{prefix}.down_proj", ts.glu(g, u))
    return lin(w, f"{prefix}.down_proj", ts.act(g).mul_(u))  # act's output is a new tensor


def softmax_topk(ts: TextSettings, logits: torch.Tensor, w: Weights):
    """qwen3_moe / mixtral: softmax over all experts, top-k, optional renormalisation."""
    probs = logits.float().softmax(dim=-1)
    weights, idx = probs.topk(ts.top_k, dim=-1)
    if ts.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, idx


def sigmoid_group_topk(ts: TextSettings, logits: torch.Tensor, w: Weights):
    """DeepSeek-V3: sigmoid scores; the bias steers selection only; groups ranked by the
    sum of their two best biased scores, top ``topk_group`` groups kept, top-k within."""
    scores = logits.float().sigmoid()
    bias = w.get("router.e_score_correction_bias")
    choice = scores + bias if bias is not None else scores
    t, e = choice.shape
    if ts.n_group > 1:
        grouped = choice.view(t, ts.n_group, e // ts.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_score.topk(ts.topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~gmask[..., None], float("-inf")).view(t, e)
    idx = choice.topk(ts.top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if ts.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * ts.routed_scaling_factor, idx


ROUTERS = {"softmax": softmax_topk, "sigmoid_group": sigmoid_group_topk}


def route(ts: TextSettings, lin: Linear, w: Weights, flat: torch.Tensor):
    """Router in float32: (weights [T, k], expert ids [T, k])."""
    logits = lin(w, "router.router", flat.float())
    return ROUTERS[ts.router](ts, logits, w)


def routed_sum(
    ts: TextSettings, lin: Linear, w: Weights, flat: torch.Tensor, weights, idx, slots=None,
    acc: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """The routed experts' weighted sum over rows ``flat`` [T, D] -> [T, D] (a partial sum
    on an expert- or tensor-parallel rank). ``slots(idx) -> bool [T, k]``: which (token,
    choice) slots this rank computes (only experts it holds, one copy of each); None
    computes every slot. acc: accumulate in this dtype (None: ``flat``'s)."""
    # one gather and one scatter for all experts: slots sorted by expert, each expert
    # runs on its contiguous run of rows (ascending expert order, as the reference sums)
    k = idx.shape[1]
    eid = idx.reshape(-1)
    wts = weights.reshape(-1)
    if slots is not None:
        keep = slots(idx).reshape(-1)
        pos = keep.nonzero().squeeze(1)
        eid, wts = eid[pos], wts[pos]
    else:
        pos = None
    order = eid.argsort(stable=True)
    slot = order if pos is None else pos[order]
    tok = slot // k
    counts = torch.bincount(eid, minlength=ts.num_experts).tolist()
    xs = flat.index_select(0, tok)  # (advanced indexing, flat[tok], is ~8x slower here)
    hit = [(e, n) for e, n in enumerate(counts) if n]  # experts with no token never run
    rows = xs.split_with_sizes([n for _, n in hit]) if hit else ()
    pairs = zip(hit, rows, strict=True)
    outs = [gated_mlp(ts, lin, w, f"routed_experts.{e}", r) for (e, _), r in pairs]
    ys = torch.cat(outs) if outs else xs  # (no slot on this rank: xs has no rows)
    if acc is not None and acc != ys.dtype:
        ys = ys.to(acc) * wts.index_select(0, order)[:, None].to(acc)
        return torch.zeros(flat.shape, dtype=acc, device=flat.device).index_add_(0, tok, ys)
    ys = ys * wts.index_select(0, order)[:, None].to(ys.dtype)
    return torch.zeros_like(flat).index_add_(0, tok, ys)


def latent_routed(
    ts: TextSettings, lin: Linear, w: Weights, flat: torch.Tensor, slots=None
) -> torch.Tensor:
    """A latent MoE's routed half up to its reduction point: route on the full hidden rows
    ``flat`` [T, H], run the experts on ``routed_expert_down_proj(flat)``, and return their
    weighted sum [T, latent] in float32 (as Moonshot sums). Under expert / tensor
    parallelism this is a partial sum that must be all-reduced before
    :func:`latent_finish` (its norm is not linear)."""
    weights, idx = route(ts, lin, w, flat)
    z = lin(w, "latent.routed_expert_down_proj", flat)
    return routed_sum(ts, lin, w, z, weights, idx, slots, acc=torch.float32)


def latent_finish(
    ts: TextSettings, lin: Linear, w: Weights, y: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The complete latent sum [T, latent] -> ``routed_expert_up_proj(norm(y))`` [T, H]."""
    y = y.to(dtype)
    if "latent.routed_expert_norm" in w:
        y = rms_norm(y, w["latent.routed_expert_norm"], ts.rms_eps)
    return lin(w, "latent.routed_expert_up_proj", y)


def moe(ts: TextSettings, lin: Linear, w: Weights, x: torch.Tensor, slots=None) -> torch.Tensor:
    """Routed experts (+ shared experts); see :func:`routed_sum` for ``slots``. Experts
    absent from ``w`` must not be selected."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if "latent.routed_expert_down_proj" in w:
        out = latent_finish(ts, lin, w, latent_routed(ts, lin, w, flat, slots), x.dtype)
    else:
        weights, idx = route(ts, lin, w, flat)
        out = routed_sum(ts, lin, w, flat, weights, idx, slots)
    if "shared_experts.gate_proj" in w:
        # [B, S, H] as transformers passes it (per-token activation scales)
        out = out + gated_mlp(ts, lin, w, "shared_experts", x).reshape(flat.shape)
    return out.view(shape)


# -- attention residuals (Kimi K3) -----------------------------------------------------
@dataclass(frozen=True)
class AttnResState:
    """The state between the layers of a model with attention residuals.

    Instead of one residual stream, K3 keeps ``blocks``: the hidden state at the start of
    every block of ``attn_res_block_size`` layers (the embeddings first), and
    ``partial``: the running sum of the current block's attention and MLP outputs. Before
    attention, before the MLP and before the final norm the input is a softmax mix of the
    RMS-normalised ``[*blocks, partial]`` (:func:`attn_res_mix`). ``partial`` is each
    layer's output (what Moonshot's ``output_hidden_states`` records, and what
    :meth:`float` gives per-layer comparisons); only it is new after a layer.

    ``Runtime.run_layer`` takes and returns this object for such models (a tensor is
    accepted at layer 0: the embeddings); it carries ``shape`` / ``dtype`` / ``to`` so
    code that passes hidden states along needs no special case.
    """

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.partial.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.partial.dtype

    @property
    def device(self) -> torch.device:
        return self.partial.device

    def float(self) -> torch.Tensor:
        """The layer output (``partial``) in float32."""
        return self.partial.float()

    def to(self, *args, **kw) -> AttnResState:
        return AttnResState(tuple(b.to(*args, **kw) for b in self.blocks),
                            self.partial.to(*args, **kw))  # fmt: skip

    def pack(self) -> torch.Tensor:
        """[len(blocks) + 1, B, S, H]: one tensor to hand between pipeline stages."""
        return torch.stack((*self.blocks, self.partial))

    @staticmethod
    def unpack(t: torch.Tensor) -> AttnResState:
        return AttnResState(tuple(t[:-1].unbind(0)), t[-1])


def layer_output(hidden):
    """A layer's output tensor: ``hidden`` itself, or an :class:`AttnResState`'s running
    sum (None stays None: a process that does not hold the layer)."""
    return hidden.partial if isinstance(hidden, AttnResState) else hidden


def blocks_before(ts: TextSettings, layer: int) -> int:
    """How many blocks an :class:`AttnResState` holds entering ``layer`` (``num_layers``:
    the head): one per block start (layers 0, N, 2N, ...) before it."""
    return -(-layer // ts.attn_res_block)


def as_attn_res(ts: TextSettings, hidden, layer: int) -> AttnResState:
    """The attention-residual state entering ``layer``: ``hidden`` itself, or the
    embeddings' (a tensor, layer 0 only)."""
    want = blocks_before(ts, layer)
    if isinstance(hidden, torch.Tensor):
        if want:
            raise ConfigError(
                f"layer {layer} of this model (attention residuals, a block every "
                f"{ts.attn_res_block} layers) needs the AttnResState that run_layer({layer - 1}) "
                f"returned, not a tensor; only layer 0 takes the embeddings as a tensor."
            )
        return AttnResState((), hidden)
    if not isinstance(hidden, AttnResState) or len(hidden.blocks) != want:
        got = len(hidden.blocks) if isinstance(hidden, AttnResState) else type(hidden).__name__
        raise ConfigError(
            f"the hidden state given to layer {layer} holds {got} attention-residual blocks; "
            f"a state entering layer {layer} holds {want}: pass what run_layer({layer - 1}) "
            f"returned."
        )
    return hidden


def attn_res_mix(
    partial: torch.Tensor, blocks: tuple[torch.Tensor, ...], norm: torch.Tensor,
    proj: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """``sum_i p_i v_i`` over ``v = [*blocks, partial]`` ([B, S, H] each), with
    ``p = softmax_i(<rms(v_i), norm * proj>)``, in float32; returned in partial's dtype.
    norm: the RMSNorm weight [H], proj: the [1, H] scoring projection."""
    v = torch.stack((*blocks, partial), dim=-2).float()  # [B, S, N, H]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    score = norm.float() * proj.reshape(-1).float()
    p = (k * score).sum(-1).softmax(-1)  # [B, S, N]
    return torch.matmul(p.unsqueeze(-2), v).squeeze(-2).to(partial.dtype)


def _mix(ts: TextSettings, w: Weights, st: AttnResState, which: str) -> torch.Tensor:
    return attn_res_mix(st.partial, st.blocks, w.need(f"attn_res.{which}_norm"),
                        w.need(f"attn_res.{which}_proj"), ts.rms_eps)  # fmt: skip


def res_pre_attention(ts: TextSettings, w: Weights, st: AttnResState, layer: int):
    """(state, attention input): the input mixes the blocks so far with the running sum
    (the running sum alone before the first block); a block starting here stores it."""
    h = _mix(ts, w, st, "self_attention_res") if st.blocks else st.partial
    if layer % ts.attn_res_block == 0:
        st = AttnResState((*st.blocks, st.partial), st.partial)
    return st, h


def res_post_attention(ts: TextSettings, w: Weights, st: AttnResState, a, layer: int):
    """(state, MLP input) after attention output ``a``: a new block's running sum starts
    at ``a``; the MLP input mixes it with the blocks."""
    partial = a if layer % ts.attn_res_block == 0 else st.partial + a
    st = AttnResState(st.blocks, partial)
    return st, _mix(ts, w, st, "mlp_res")


def res_output(ts: TextSettings, w: Weights, st: AttnResState) -> torch.Tensor:
    """The final norm's input: the last state mixed with ``output_attn_res_*``."""
    return _mix(ts, w, st, "output_attn_res")


# -- layers ----------------------------------------------------------------------------
def attention_block(
    ts: TextSettings, lin: Linear, w: Weights, x: torch.Tensor, layer: int, step: Step, cache=None
) -> torch.Tensor:
    """The attention half of a layer without its residual: o_proj's output (a partial
    sum on a tensor-parallel rank). KDA layers keep their recurrent state in
    ``cache.recurrent`` (a :class:`~.kda.KDAState`, made on first use)."""
    h = rms_norm(x, w.need("norms.input_layernorm"), ts.rms_eps)
    kind = ts.attention_of(layer)
    if kind == "kda":
        state = None
        if cache is not None:
            if cache.recurrent is None:
                cache.recurrent = KDAState()
            state = cache.recurrent
        return kda_attention(ts.kda, lin, w, h, step.tokens, state)
    mask = step.masks[ts.windows[layer]]
    return ATTENTION[kind](ts, lin, w, h, mask, step, cache, layer)


def mlp_block(ts: TextSettings, lin: Linear, w: Weights, x: torch.Tensor, slots=None):
    """The MLP / MoE half of a layer without its residual (a partial sum under TP / EP;
    a latent MoE needs :func:`latent_routed` / :func:`latent_finish` there instead)."""
    h = rms_norm(x, w.need("norms.post_attention_layernorm"), ts.rms_eps)
    if "router.router" in w:
        return moe(ts, lin, w, h, slots)
    return gated_mlp(ts, lin, w, "dense_mlp", h)


def decoder_layer(ts: TextSettings, lin: Linear, w: Weights, x, layer: int, step: Step, cache=None):
    """One layer: hidden [B, S, H] -> [B, S, H]; with attention residuals an
    :class:`AttnResState` -> the next one."""
    if ts.attn_res_block is None:
        x = x + attention_block(ts, lin, w, x, layer, step, cache)
        return x + mlp_block(ts, lin, w, x)
    st, h = res_pre_attention(ts, w, x, layer)
    st, h = res_post_attention(ts, w, st, attention_block(ts, lin, w, h, layer, step, cache), layer)
    return AttnResState(st.blocks, st.partial + mlp_block(ts, lin, w, h))


def make_step(
    ts: TextSettings,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    device: torch.device,
    past: int = 0,
    fused_mla: bool = True,
) -> Step:
    """Rope tables for the query positions; masks over ``past + S`` keys.
    attention_mask: [B, past + S] (1 = real token) or None. fused_mla: see :class:`Step`."""
    b, s = position_ids.shape
    cos = sin = None
    if ts.rotary is not None:
        cos, sin = ts.rotary.cos_sin(position_ids.to(device))
    masks = {
        win: build_mask(attention_mask, s, batch=b, window=win, device=device, past=past)
        for win in set(ts.windows)
    }
    tokens = None
    if "kda" in ts.layer_attention and attention_mask is not None:
        tokens = attention_mask[:, -s:].to(device)
    return Step(cos, sin, masks, past, fused_mla, tokens)


def linear_plain(w: Weights, key: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.need(key), w.get(key + "_bias"))
