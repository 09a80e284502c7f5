"""KV caches for incremental decoding: ``prefill`` fills them, every ``decode`` step
appends one token per sequence and attends over everything cached.

Each attention kind owns its cache layout:

- GQA: per-head K and V, ``[B, kv_heads, S, head_dim]`` (what transformers caches);
- MLA ``expanded``: the per-head K (nope + rope) and V after ``kv_b_proj``, the layout
  transformers' DeepSeek-V3 caches;
- MLA ``latent``: only the normed latent ``[B, S, kv_lora_rank]`` and the roped shared
  key ``[B, S, qk_rope]`` (576 numbers per token for DeepSeek-V3 instead of 128 heads x
  (192 + 128)); attention runs in the latent space with ``kv_b_proj``'s halves absorbed
  into the query and the output, as DeepSeek's reference inference does;
- KDA (the linear-attention layers of kimi_linear / Kimi K3): no per-token cache at all,
  a fixed-size state per layer (:class:`~k3convert.runtime.kda.KDAState` in
  ``LayerCache.recurrent``: the last ``conv_kernel - 1`` inputs of the q / k / v short
  convolutions and the recurrent state ``[B, heads, head_dim, head_dim]`` in float32),
  updated in place by every chunk; it does not grow with the context. The hybrid models'
  MLA layers cache as above.

``kv_dtype="fp8"`` stores every cached tensor as float8 e4m3 with one scale per tensor
kind and layer (``k`` / ``v`` / ``latent`` / ``k_rot``): the scale the caller passes in
``scales`` (calibrated), else a dynamic scale fixed by the first (prefill) chunk,
``amax / 448``, as serving engines compute it on the first forward. (A checkpoint's
calibrated ``kv_cache_scheme`` scales are applied before the cache, by the runtime's fake
quantization, see :func:`~k3convert.runtime.decoder.kv_enter`; ``verify --kv-cache fp8``
then stores those already-rounded values.) Later tokens are quantized with that
scale (saturating at +-448); attention reads the dequantized values. KDA states are
always kept in float32 (the reference's state dtype), whatever ``kv_dtype`` says.

One cache serves one rank: a tensor-parallel run keeps one per rank (local heads only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..formats import FP8_MAX

MLA_CACHES = ("expanded", "latent")
KV_DTYPES = (None, "fp8")
FP8 = torch.float8_e4m3fn


@dataclass
class _Stored:
    """One cached tensor kind of one layer: data along dim ``dim`` (the token axis)."""

    dim: int
    data: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # fp8 only: float32 scalar

    def append(self, x: torch.Tensor, fp8: bool, scale: float | None) -> torch.Tensor:
        """Append ``x`` and return everything cached so far, in ``x``'s dtype."""
        if not fp8:
            self.data = x if self.data is None else torch.cat((self.data, x), dim=self.dim)
            return self.data
        if self.scale is None:
            if scale is not None:
                self.scale = torch.tensor(float(scale), dtype=torch.float32)
            else:
                amax = x.detach().abs().amax().float()
                self.scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        s = self.scale.to(x.device)
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.data = q if self.data is None else torch.cat((self.data, q), dim=self.dim)
        return (self.data.float() * s).to(x.dtype)


@dataclass
class LayerCache:
    """The cache of one attention layer (of one rank): growing ``parts`` (K / V, MLA
    latents) or, for a KDA layer, the fixed-size ``recurrent`` state."""

    fp8: bool
    mla: str = "expanded"
    scales: dict[str, float] = field(default_factory=dict)
    parts: dict[str, _Stored] = field(default_factory=dict)
    recurrent: Any = None  # kda.KDAState of a KDA layer (made by its first chunk)

    def append(self, kind: str, x: torch.Tensor, dim: int) -> torch.Tensor:
        st = self.parts.get(kind)
        if st is None:
            st = self.parts[kind] = _Stored(dim)
        return st.append(x, self.fp8, self.scales.get(kind))

    def nbytes(self) -> int:
        kv = sum(
            p.data.numel() * p.data.element_size()
            for p in self.parts.values()
            if p.data is not None
        )
        return kv + self.recurrent_nbytes()

    def recurrent_nbytes(self) -> int:
        return self.recurrent.nbytes() if self.recurrent is not None else 0


class KVCache:
    """Caches of every attention layer of one rank, and how many tokens they hold.

    mla: ``expanded`` (default) or ``latent``; kv_dtype: None (compute dtype) or
    ``fp8``; scales: ``{layer: {"k": s, "v": s}}`` calibrated per-tensor scales (fp8).
    """

    def __init__(
        self,
        *,
        mla: str = "expanded",
        kv_dtype: str | None = None,
        scales: dict[int, dict[str, float]] | None = None,
    ):
        if mla not in MLA_CACHES:
            raise ConfigError(
                f"MLA cache '{mla}' is not known; use one of {', '.join(MLA_CACHES)}."
            )
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(
                f"KV cache dtype '{kv_dtype}' is not known; use fp8 or leave it unset."
            )
        self.mla = mla
        self.kv_dtype = kv_dtype
        self.scales = scales or {}
        self.length = 0  # tokens cached per sequence
        self.layers: dict[int, LayerCache] = {}

    def layer(self, i: int) -> LayerCache:
        c = self.layers.get(i)
        if c is None:
            c = self.layers[i] = LayerCache(
                self.kv_dtype == "fp8", self.mla, dict(self.scales.get(i, {}))
            )
        return c

    def for_rank(self, rank: int) -> KVCache:
        """The cache of one tensor-parallel rank (its local heads); ``length`` is kept
        by this, the parent cache."""
        kids = self.__dict__.setdefault("_ranks", {})
        if rank not in kids:
            kids[rank] = KVCache(mla=self.mla, kv_dtype=self.kv_dtype, scales=self.scales)
        return kids[rank]

    def advance(self, n: int) -> None:
        self.length += n

    def _all(self) -> list[LayerCache]:
        kids = self.__dict__.get("_ranks", {})
        return [*self.layers.values(), *(c for k in kids.values() for c in k._all())]

    def nbytes(self) -> int:
        """Bytes held: every layer's K / V (or latents) and KDA states, of every rank."""
        return sum(c.nbytes() for c in self._all())

    def state_nbytes(self) -> int:
        """The fixed-size part of :meth:`nbytes`: the KDA layers' states."""
        return sum(c.recurrent_nbytes() for c in self._all())

    def describe(self, attention: str = "mla") -> str:
        dt = "fp8 e4m3, per-tensor scales" if self.kv_dtype == "fp8" else "compute dtype"
        kind = f"MLA {self.mla}" if attention == "mla" else "per-head K/V"
        out = f"{kind} / {dt}"
        n = sum(c.recurrent is not None for c in self._all())
        if n:
            out += (
                f"; KDA state (conv + recurrent, float32, fixed size): {n} layer x rank "
                f"cache(s), {self.state_nbytes() / 2**20:.3f} MiB"
            )
        return out
