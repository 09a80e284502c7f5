"""Kimi-Linear / Kimi K3 text: a hybrid of KDA (linear attention) and MLA layers + MoE.

``kimi_linear`` is transformers' family (Kimi-Linear 48B-A3B); Kimi K3's ``text_config``
uses the same ``model_type`` with more features, all read from the config:

- **KDA layers** (Kimi Delta Attention, a gated delta rule with a fixed-size recurrent
  state): ``q/k/v_proj`` [H*D, hidden], depthwise causal ``q/k/v_conv1d`` [H*D, 1, K],
  ``A_log`` (one decay rate per head; transformers stores [1, 1, H, 1], the K3 release a
  padded vector whose first H entries are used), ``dt_bias`` [H*D], the forget gate's
  low-rank ``f_a_proj`` [D, hidden] / ``f_b_proj`` [H*D, D], ``b_proj`` [H, hidden]
  (beta), the output gate (``g_proj`` [H*D, hidden] when ``use_full_rank_gate``, else
  ``g_a_proj`` / ``g_b_proj``), ``o_norm`` [D] and ``o_proj`` [hidden, H*D]. Which layers
  are KDA comes from ``linear_attn_config`` (1-based ``kda_layers`` / ``full_attn_layers``)
  or transformers' ``layer_types``.
- **MLA layers**: DeepSeek-V3's rows; K3 adds an output gate ``g_proj`` [heads*v, hidden]
  (``mla_use_output_gate``) and runs without rotary (``mla_use_nope``).
- **MoE** under ``block_sparse_moe.``: sigmoid router + ``e_score_correction_bias``,
  shared experts, routed experts ``experts.E.w1/w3/w2``. A *latent* MoE
  (``routed_expert_hidden_size``, K3) runs the routed experts in a narrower space:
  ``routed_expert_down_proj`` [latent, hidden] before them, ``routed_expert_norm``
  [latent] and ``routed_expert_up_proj`` [hidden, latent] after the weighted sum.
- **Attention residuals** (``attn_res_block_size``, K3): per layer two RMSNorm weights and
  two [1, hidden] scoring projections, plus ``output_attn_res_norm`` /
  ``output_attn_res_proj`` before the final norm.

Dense layers are spelled ``mlp.gate_proj`` in the releases; transformers 5.24's
``save_pretrained`` writes them as ``block_sparse_moe.gate_proj`` (accepted as an alias).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, short_repr
from . import deepseek_v3
from .base import Arch, check_routing, count, finite, positive, register, req
from .base import TensorSpec as T
from .common import embed_and_head, kv_scales, layer_norms, router


@dataclass(frozen=True)
class KimiLinearConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # MLA heads
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    kda_layers: frozenset[int]  # 0-based
    gate_lower_bound: float | None
    full_rank_gate: bool
    a_log_shape: tuple[int, ...]
    a_log_stored: tuple[int, ...] | None
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_output_gate: bool
    attention_bias: bool
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    moe_layers: frozenset[int]
    latent_size: int | None
    latent_norm: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    attn_res_block_size: int | None
    tie_word_embeddings: bool
    num_mtp: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def expert_hidden(self) -> int:
        """Width the routed experts work in (the latent space of a latent MoE)."""
        return self.latent_size or self.hidden_size

    @property
    def num_kv_heads(self) -> int:  # MLA: one latent shared by every head
        return self.num_heads

    def is_kda_layer(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers


def _one_based(v, key: str, n: int, where: str) -> list[int]:
    ints = isinstance(v, list) and all(type(x) is int for x in v)
    if not ints:
        raise ConfigError(
            f"{where}: linear_attn_config.{key} must be a list of 1-based layer numbers, got "
            f"{short_repr(v)}."
        )
    bad = [x for x in v if not 1 <= x <= n]
    if bad:
        raise ConfigError(
            f"{where}: linear_attn_config.{key} names layer(s) {bad[:6]} but "
            f"num_hidden_layers is {n} (layers are numbered 1..{n}); the layer lists "
            f"contradict num_hidden_layers."
        )
    return [x - 1 for x in v]


def _kda_layers(raw: dict, lac: dict, n: int, where: str) -> frozenset[int]:
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda = _one_based(lac.get("kda_layers"), "kda_layers", n, where)
        full = _one_based(lac.get("full_attn_layers"), "full_attn_layers", n, where)
        both = sorted(set(kda) & set(full))
        missing = sorted(set(range(n)) - set(kda) - set(full))
        if both or missing or len(set(kda)) != len(kda) or len(set(full)) != len(full):
            what = (
                f"layer(s) {[i + 1 for i in both][:6]} are in both lists"
                if both
                else f"layer(s) {[i + 1 for i in missing][:6]} are in neither list"
                if missing
                else "a list repeats a layer"
            )
            raise ConfigError(
                f"{where}: linear_attn_config.kda_layers and full_attn_layers must "
                f"partition the {n} layers (1-based); {what}."
            )
        return frozenset(kda)
    kda = _typed_layers(raw, "layer_types", ("linear_attention", "full_attention"), n, where)
    if kda is not None:
        return kda
    raise ConfigError(
        f"{where}: a kimi_linear config needs linear_attn_config.kda_layers / "
        f"full_attn_layers (or layer_types) to say which layers are KDA."
    )


def _typed_layers(raw: dict, key: str, kinds: tuple[str, str], n: int, where: str):
    """transformers' per-layer type list ``key`` (one of ``kinds`` per layer) -> the
    layers of ``kinds[0]``; None when the config has no such list."""
    types = raw.get(key)
    if not isinstance(types, list):
        return None
    if len(types) != n or not set(types) <= set(kinds):
        raise ConfigError(
            f"{where}: '{key}' must list '{kinds[0]}' or '{kinds[1]}' for each of the {n} "
            f"layers, got {short_repr(types)}."
        )
    return frozenset(i for i, t in enumerate(types) if t == kinds[0])


def _moe_layers(raw: dict, n: int, experts: int, where: str) -> frozenset[int]:
    if not experts:
        return frozenset()
    moe = _typed_layers(raw, "mlp_layer_types", ("sparse", "dense"), n, where)
    if moe is not None:
        return moe
    first = count(raw.get("first_k_dense_replace"), "first_k_dense_replace", where)
    freq = positive(raw.get("moe_layer_freq") or 1, "moe_layer_freq", where)
    return frozenset(i for i in range(n) if i >= first and i % freq == 0)


def parse(raw: dict, where: str = "config.json", *, family: str = "kimi_linear"):
    g = lambda k, *alts: req(raw, k, where, *alts)  # noqa: E731
    p = lambda k, *alts: positive(g(k, *alts), k, where)  # noqa: E731
    n = p("num_hidden_layers")
    lac = raw.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"{where}: 'linear_attn_config' must be an object.")
    kda_heads = positive(
        lac.get("num_heads") or raw.get("linear_num_heads"), "linear_attn_config.num_heads", where
    )
    kda_dim = positive(
        lac.get("head_dim") or raw.get("linear_head_dim"), "linear_attn_config.head_dim", where
    )
    kernel = positive(
        lac.get("short_conv_kernel_size") or raw.get("linear_conv_kernel_dim") or 4,
        "short_conv_kernel_size",
        where,
    )
    lb = lac.get("gate_lower_bound")
    lower = None
    if lb is not None:
        if isinstance(lb, bool) or not isinstance(lb, int | float) or not lb < 0:
            raise ConfigError(
                f"{where}: linear_attn_config.gate_lower_bound must be a negative number, got "
                f"{short_repr(lb)}."
            )
        lower = float(lb)
    experts = count(raw.get("num_experts", raw.get("num_local_experts")), "num_experts", where)
    topk = raw.get("num_experts_per_token", raw.get("num_experts_per_tok"))
    topk = count(topk, "num_experts_per_tok", where)
    n_group = positive(
        raw.get("num_expert_group") or raw.get("n_group") or 1, "num_expert_group", where
    )
    topk_group = positive(raw.get("topk_group") or 1, "topk_group", where)
    keys = ("num_experts", "num_experts_per_token", "num_expert_group")
    check_routing(experts, topk, n_group, topk_group, where, keys)
    if int(raw.get("num_nextn_predict_layers") or 0):
        raise ConfigError(
            f"{where}: num_nextn_predict_layers > 0 (multi-token prediction layers) is not "
            f"supported for {family}."
        )
    q_lora = raw.get("q_lora_rank")
    latent = raw.get("routed_expert_hidden_size")
    block = raw.get("attn_res_block_size")
    if family == "kimi_k3":  # one rate per head; the release pads the vector to 128 entries
        a_log, a_log_stored = (kda_heads,), (max(kda_heads, kda_dim),)
    else:  # transformers' layout
        a_log, a_log_stored = (1, 1, kda_heads, 1), None
    shared = raw.get("num_shared_experts", raw.get("n_shared_experts"))
    return KimiLinearConfig(
        model_type=raw.get("model_type", family),
        vocab_size=p("vocab_size"),
        hidden_size=p("hidden_size"),
        num_layers=n,
        num_heads=p("num_attention_heads"),
        kda_num_heads=kda_heads,
        kda_head_dim=kda_dim,
        conv_kernel=kernel,
        kda_layers=_kda_layers(raw, lac, n, where),
        gate_lower_bound=lower,
        full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        a_log_shape=a_log,
        a_log_stored=a_log_stored if a_log_stored != a_log else None,
        q_lora_rank=positive(q_lora, "q_lora_rank", where) if q_lora else None,
        kv_lora_rank=p("kv_lora_rank"),
        qk_nope_head_dim=p("qk_nope_head_dim"),
        qk_rope_head_dim=p("qk_rope_head_dim"),
        v_head_dim=p("v_head_dim"),
        mla_use_nope=bool(raw.get("mla_use_nope", family == "kimi_linear")),
        mla_output_gate=bool(raw.get("mla_use_output_gate", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        intermediate_size=p("intermediate_size"),
        moe_intermediate_size=positive(
            raw.get("moe_intermediate_size") or raw["intermediate_size"],
            "moe_intermediate_size",
            where,
        ),
        num_experts=experts,
        num_shared_experts=count(shared, "num_shared_experts", where) if experts else 0,
        num_experts_per_tok=topk,
        moe_layers=_moe_layers(raw, n, experts, where),
        latent_size=positive(latent, "routed_expert_hidden_size", where) if latent else None,
        latent_norm=bool(raw.get("latent_moe_use_norm", False)) and bool(latent),
        n_group=n_group,
        topk_group=topk_group,
        # absent: transformers' KimiLinearConfig default (2.446), Moonshot's K3 one (1.0)
        routed_scaling_factor=finite(
            raw.get("routed_scaling_factor"),
            "routed_scaling_factor",
            where,
            1.0 if family == "kimi_k3" else 2.446,
        ),
        norm_topk_prob=bool(raw.get("moe_renormalize", raw.get("norm_topk_prob", True))),
        attn_res_block_size=positive(block, "attn_res_block_size", where) if block else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def kda_attention(a: str) -> list[T]:
    """Rows of a KDA layer's ``self_attn.`` (component ``linear_attention``)."""
    H = lambda c: c.hidden_size  # noqa: E731
    P = lambda c: c.kda_dim  # noqa: E731
    D = lambda c: c.kda_head_dim  # noqa: E731
    low = lambda c: not c.full_rank_gate  # noqa: E731
    s = "kda_layer"
    la = "linear_attention"
    return [
        *(T(f"{a}{x}_proj.weight", s, la, f"{x}_proj", lambda c: (P(c), H(c)), "kda_heads")
          for x in "qkv"),
        *(T(f"{a}{x}_conv1d.weight", s, la, f"{x}_conv1d",
            lambda c: (P(c), 1, c.conv_kernel), "kda_heads", keep=True)
          for x in "qkv"),
        T(f"{a}A_log", s, la, "A_log", lambda c: c.a_log_shape, "kda_a_log", keep=True,
          stored=lambda c: c.a_log_stored),
        T(f"{a}dt_bias", s, la, "dt_bias", lambda c: (P(c),), "kda_heads", keep=True),
        T(f"{a}f_a_proj.weight", s, la, "f_a_proj", lambda c: (D(c), H(c)), keep=True),
        T(f"{a}f_b_proj.weight", s, la, "f_b_proj", lambda c: (P(c), D(c)), "kda_heads",
          keep=True),
        T(f"{a}b_proj.weight", s, la, "b_proj", lambda c: (c.kda_num_heads, H(c)),
          "kda_heads", keep=True),
        T(f"{a}g_proj.weight", s, la, "g_proj", lambda c: (P(c), H(c)), "kda_heads",
          when=lambda c: c.full_rank_gate),
        T(f"{a}g_a_proj.weight", s, la, "g_a_proj", lambda c: (D(c), H(c)), keep=True,
          when=low),
        T(f"{a}g_b_proj.weight", s, la, "g_b_proj", lambda c: (P(c), D(c)), "kda_heads",
          keep=True, when=low),
        T(f"{a}o_norm.weight", s, "norms", "o_norm", lambda c: (D(c),), keep=True),
        T(f"{a}o_proj.weight", s, la, "o_proj", lambda c: (H(c), P(c)), "kda_row"),
    ]  # fmt: skip


def mla_attention(a: str) -> list[T]:
    """DeepSeek-V3's MLA rows on the full-attention layers, plus K3's output gate."""
    rows = [
        T(r.pattern, "mla_layer", r.component, r.kind, r.shape, r.split, r.keep, r.when, r.aliases)
        for r in deepseek_v3.mla_attention(a)
    ]
    rows.append(
        T(f"{a}g_proj.weight", "mla_layer", "attention", "g_proj",
          lambda c: (c.num_heads * c.v_head_dim, c.hidden_size), "heads",
          when=lambda c: c.mla_output_gate)
    )  # fmt: skip
    return rows


def attn_res(L: str, p: str) -> list[T]:
    H = lambda c: c.hidden_size  # noqa: E731
    on = lambda c: c.attn_res_block_size is not None  # noqa: E731
    rows = []
    for x in ("self_attention_res", "mlp_res"):
        rows += [
            T(f"{L}{x}_norm.weight", "layer", "attn_res", f"{x}_norm", lambda c: (H(c),),
              keep=True, when=on),
            T(f"{L}{x}_proj.weight", "layer", "attn_res", f"{x}_proj", lambda c: (1, H(c)),
              keep=True, when=on),
        ]  # fmt: skip
    rows += [
        T(f"{p}output_attn_res_norm.weight", "global", "attn_res", "output_attn_res_norm",
          lambda c: (H(c),), keep=True, when=on),
        T(f"{p}output_attn_res_proj.weight", "global", "attn_res", "output_attn_res_proj",
          lambda c: (1, H(c)), keep=True, when=on),
    ]  # fmt: skip
    return rows


def moe(m: str) -> list[T]:
    """``block_sparse_moe.``: router, shared experts, latent projections, routed experts."""
    H = lambda c: c.hidden_size  # noqa: E731
    X = lambda c: c.expert_hidden  # noqa: E731
    I = lambda c: c.moe_intermediate_size  # noqa: E731, E741
    S = lambda c: c.moe_intermediate_size * c.num_shared_experts  # noqa: E731
    latent = lambda c: c.latent_size is not None  # noqa: E731
    E = m + "experts.{E}."
    return [
        *router(m + "gate."),
        T(m + "gate.e_score_correction_bias", "moe_layer", "router", "e_score_correction_bias",
          lambda c: (c.num_experts,), keep=True),
        T(m + "shared_experts.gate_proj.weight", "moe_layer", "shared_experts", "gate_proj",
          lambda c: (S(c), H(c)), "col", when=lambda c: c.num_shared_experts > 0),
        T(m + "shared_experts.up_proj.weight", "moe_layer", "shared_experts", "up_proj",
          lambda c: (S(c), H(c)), "col", when=lambda c: c.num_shared_experts > 0),
        T(m + "shared_experts.down_proj.weight", "moe_layer", "shared_experts", "down_proj",
          lambda c: (H(c), S(c)), "row", when=lambda c: c.num_shared_experts > 0),
        T(m + "routed_expert_down_proj.weight", "moe_layer", "latent",
          "routed_expert_down_proj", lambda c: (c.latent_size, H(c)), when=latent),
        T(m + "routed_expert_norm.weight", "moe_layer", "latent", "routed_expert_norm",
          lambda c: (c.latent_size,), keep=True, when=lambda c: c.latent_norm),
        T(m + "routed_expert_up_proj.weight", "moe_layer", "latent", "routed_expert_up_proj",
          lambda c: (H(c), c.latent_size), when=latent),
        T(E + "w1.weight", "expert", "routed_experts", "gate_proj", lambda c: (I(c), X(c)), "col"),
        T(E + "w3.weight", "expert", "routed_experts", "up_proj", lambda c: (I(c), X(c)), "col"),
        T(E + "w2.weight", "expert", "routed_experts", "down_proj", lambda c: (X(c), I(c)), "row"),
    ]  # fmt: skip


def dense_mlp(L: str) -> list[T]:
    H = lambda c: c.hidden_size  # noqa: E731
    W = lambda c: c.intermediate_size  # noqa: E731
    rows = []
    for x, shape, split in (
        ("gate", lambda c: (W(c), H(c)), "col"),
        ("up", lambda c: (W(c), H(c)), "col"),
        ("down", lambda c: (H(c), W(c)), "row"),
    ):
        rows.append(
            T(
                f"{L}mlp.{x}_proj.weight",
                "dense_layer",
                "dense_mlp",
                f"{x}_proj",
                shape,
                split,
                aliases=(f"{L}block_sparse_moe.{x}_proj.weight",),
            )
        )
    return rows  # fmt: skip


def lm_specs(p: str, head: str) -> list[T]:
    """The decoder under name prefix ``p`` ('model.' or 'language_model.model.')."""
    L = p + "layers.{L}."
    return [
        *embed_and_head(p, head),
        *layer_norms(L),
        *kda_attention(L + "self_attn."),
        *mla_attention(L + "self_attn."),
        # every layer matches, so a KDA layer's scale is refused by name (check_kv_scales)
        *kv_scales(L + "self_attn."),
        *attn_res(L, p),
        *dense_mlp(L),
        *moe(L + "block_sparse_moe."),
    ]


def specs(c: KimiLinearConfig) -> list[T]:
    return lm_specs("model.", "lm_head.weight")


KIMI_LINEAR = register(
    Arch(
        "kimi_linear",
        (),
        parse,
        specs,
        doc="KDA linear attention + MLA hybrid with sigmoid-routed MoE (Kimi-Linear)",
        attention="mla",
        router="sigmoid_group",
        hybrid=True,
    )
)
