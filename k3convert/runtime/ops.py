"""Small numeric building blocks: norms, activations, masks, attention, hooked linears.

Norm statistics are taken in float32 whatever the compute dtype. Attention goes through
``torch.nn.functional.scaled_dot_product_attention`` (any device) with a boolean mask.
Gated MLPs combine gate and up with ``act(gate) * up``, or, for Kimi K3's ``situ``
activation, with :class:`SiTU` (both branches squashed, in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..arch.base import finite
from ..errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str | None, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name or "silu"]
    except KeyError:
        raise ConfigError(
            f"{where}: hidden_act '{name}' is not supported by the runtime; supported: "
            f"{', '.join(ACTIVATIONS)}."
        ) from None


@dataclass(frozen=True)
class SiTU:
    """Kimi K3's gated activation ``hidden_act: situ``, the product of both MLP branches:
    ``beta * tanh(gate / beta) * sigmoid(gate) * up'`` with ``up' = linear_beta *
    tanh(up / linear_beta)`` (``up' = up`` without a linear beta). Computed in float32,
    returned in the inputs' dtype (Moonshot's ``SituAndMul``). beta: the config's
    ``activation_situ_beta`` (1.0 when unset), linear_beta: ``activation_situ_linear_beta``.
    """

    beta: float = 1.0
    linear_beta: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = gate.float(), up.float()
        a = torch.tanh(g / self.beta).mul_(self.beta).mul_(torch.sigmoid(g))
        if self.linear_beta is not None:
            u = torch.tanh(u / self.linear_beta).mul_(self.linear_beta)
        return a.mul_(u).to(gate.dtype)


def situ(raw: dict, where: str) -> SiTU:
    """:class:`SiTU` with the betas of a raw text config (positive and finite; an unset or
    zero beta is 1.0, as Moonshot's ``beta or 1.0``)."""
    beta = raw.get("activation_situ_beta") or None
    lin = raw.get("activation_situ_linear_beta")
    return SiTU(
        finite(beta, "activation_situ_beta", where, 1.0),
        None if lin is None else finite(lin, "activation_situ_linear_beta", where, 1.0),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps).to(x.dtype)


def attention_mask(
    attention_mask: torch.Tensor | None,
    position_count: int,
    *,
    batch: int,
    window: int | None,
    device: torch.device,
    past: int = 0,
) -> torch.Tensor | None:
    """Boolean [B, 1, S, past + S] mask (True = may attend): causal, padding, window.

    ``past`` cached keys precede the S queries (query i sits at key index past + i);
    attention_mask covers all past + S keys. None when plain causal attention needs no
    mask (no cache, no padding, no window). Query rows that could see no key (left
    padding) are opened to every key: their outputs are garbage by definition but stay
    finite, so they cannot poison real tokens through 0 * NaN.
    """
    if attention_mask is None and window is None and past == 0:
        return None
    s = position_count
    t = past + s
    qi = torch.arange(past, t, device=device)
    ki = torch.arange(t, device=device)
    allowed = ki[None, :] <= qi[:, None]
    if window is not None:
        allowed = allowed & ((qi[:, None] - ki[None, :]) < window)
    allowed = allowed[None, None].expand(batch, 1, s, t)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    empty = ~allowed.any(-1, keepdim=True)
    return allowed | empty


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    causal: bool,
    v_cols: slice | None = None,
) -> torch.Tensor:
    """q: [B, Hq, S, D], k: [B, Hkv, S, D], v: [B, Hkv, S, Dv] -> [B, S, Hq * Dv].

    v_cols: keep only these columns of each head's output (values laid out wider than
    they are, so sdpa can take its fused kernel; see ``decoder._flash_values``)."""
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=gqa
    )
    if v_cols is not None:
        o = o[..., v_cols]
    b, h, s, d = o.shape
    return o.transpose(1, 2).reshape(b, s, h * d)


#: hook(name, input, output) -> None or a replacement output
LinearHook = Callable[[str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]
