"""KV cache, KDA state and activations per rank for a serving workload (see the
package docstring for the formulas)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..layout import divisors

#: --kv-dtype -> bytes per cached value
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


#: activation (and KDA conv state) bytes: bf16
ACT_BYTES = 2


@dataclass(frozen=True)
class Workload:
    """What the ranks serve: ``context`` tokens per sequence, ``batch`` sequences, the
    KV-cache dtype and the prefill chunk (tokens per forward of a chunked prefill)."""

    context: int = 131072
    batch: int = 1
    kv_dtype: str = "bf16"
    prefill_chunk: int = 8192

    def __post_init__(self):
        for k in ("context", "batch", "prefill_chunk"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}.")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(
                f"--kv-dtype '{self.kv_dtype}' is not known; use one of {', '.join(KV_DTYPES)}."
            )

    @property
    def kv_bytes(self) -> int:
        return KV_DTYPES[self.kv_dtype]

    @property
    def chunk_tokens(self) -> int:
        return min(self.prefill_chunk, self.batch * self.context)


class LayerModel:
    """Per-layer cache, state and activation arithmetic of a config (see the module doc)."""

    def __init__(self, cfg: Any):
        self.text = text = getattr(cfg, "text", cfg)
        self.n = text.num_layers
        kda = getattr(text, "is_kda_layer", None)
        mla = hasattr(text, "kv_lora_rank")
        self.kinds = [
            "kda" if kda is not None and kda(i) else "mla" if mla else "gqa" for i in range(self.n)
        ]

    # -- degrees the model allows ---------------------------------------------------------
    def head_counts(self) -> list[tuple[str, int]]:
        t = self.text
        out = [("attention heads", t.num_heads)]
        if "kda" in self.kinds:
            out.append(("KDA heads", t.kda_num_heads))
        return out

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp`` cannot split the heads (and GQA's KV heads) evenly; None if it can."""
        for what, n in self.head_counts():
            if n % tp:
                return f"--tp {tp} does not divide the model's {n} {what}"
        if "gqa" in self.kinds:
            kv = self.text.num_kv_heads
            if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
                return (
                    f"--tp {tp} cannot split the {kv} KV heads (tp must divide them, or be a "
                    f"multiple of them to replicate them)"
                )
        return None

    def check_tp(self, tp: int) -> None:
        why = self.tp_problem(tp)
        if why:
            raise ConfigError(f"{why}; legal tp: {self.legal_tp()}.")

    def legal_tp(self) -> list[int]:
        return [tp for tp in divisors(self.text.num_heads) if self.tp_problem(tp) is None]

    # -- per layer ------------------------------------------------------------------------
    def kv_local(self, tp: int) -> int:
        kv = self.text.num_kv_heads
        return kv // tp if tp <= kv else 1

    def kv_cache(self, i: int, tp: int, w: Workload) -> int:
        """Per-token cache of layer ``i`` on one rank, times context and batch."""
        t, k = self.text, self.kinds[i]
        if k == "kda":
            return 0
        if k == "mla":
            per_token = t.kv_lora_rank + t.qk_rope_head_dim
        else:
            per_token = 2 * self.kv_local(tp) * t.head_dim
        return per_token * w.context * w.batch * w.kv_bytes

    def kda_state(self, i: int, tp: int, w: Workload) -> int:
        if self.kinds[i] != "kda":
            return 0
        t = self.text
        h, d = t.kda_num_heads // tp, t.kda_head_dim
        return w.batch * (h * d * d * F32 + 3 * h * d * (t.conv_kernel - 1) * ACT_BYTES)

    def activations(self, i: int, tp: int, ep: int, w: Workload) -> int:
        """Estimated peak working set of layer ``i`` for one prefill chunk (module doc)."""
        t, a, T = self.text, ACT_BYTES, w.chunk_tokens
        moe_tp = tp // ep
        resid = 3 * T * t.hidden_size * a
        k = self.kinds[i]
        if k == "gqa":
            hl, d = t.num_heads // tp, t.head_dim
            attn = T * a * (2 * hl * d + 2 * self.kv_local(tp) * d)
        elif k == "mla":
            hl = t.num_heads // tp
            comp = (t.q_lora_rank or 0) + t.kv_lora_rank + t.qk_rope_head_dim
            qk = t.qk_nope_head_dim + t.qk_rope_head_dim
            attn = T * a * (comp + hl * (2 * qk + 2 * t.v_head_dim))
        else:
            hl, d = t.kda_num_heads // tp, t.kda_head_dim
            attn = T * hl * d * (4 * a + 5 * F32)
        if t.is_moe_layer(i) and t.num_experts:
            he = getattr(t, "expert_hidden", t.hidden_size)
            ie = t.moe_intermediate_size
            slots = -(-T * t.num_experts_per_tok // ep)
            mlp = slots * a * (2 * he + 3 * -(-ie // moe_tp))
            mlp += T * t.num_experts * F32
            shared = getattr(t, "num_shared_experts", 0) or 0
            mlp += 3 * T * a * -(-(shared * ie) // tp)
            if getattr(t, "latent_size", None):
                mlp += 2 * T * he * a
        else:
            mlp = 3 * T * a * -(-t.intermediate_size // tp)
        return resid + max(attn, mlp)

    def logits(self, w: Workload) -> int:
        return w.batch * self.text.vocab_size * F32


F32 = 4
