"""Kimi Delta Attention (KDA): the linear-attention layers of Kimi-Linear and Kimi K3.

A KDA layer keeps, per sequence and head, a fixed-size state ``S`` [K, V] (K = V =
head_dim) instead of a KV cache. Per token t, with per-channel log-decay ``g_t`` [K]:

    S <- diag(exp(g_t)) S                      (forget, per key channel)
    S <- S + beta_t k_t (v_t - S^T k_t)^T      (delta rule: write v_t at k_t)
    o_t = S^T (scale * q_t)

q, k, v are the q/k/v projections through a causal depthwise short convolution (kernel
``conv_kernel``) and SiLU; q and k are L2-normalised per head (``x / sqrt(sum x^2 +
1e-6)``, the eps of fla's kernel), ``scale = head_dim ** -0.5``, ``beta = sigmoid(b_proj
x)``. The forget gate comes from a low-rank ``f_b_proj(f_a_proj(x))`` plus ``dt_bias``:

- K3 (``gate_lower_bound`` set): ``g = lb * sigmoid(exp(A_log) * (f + dt_bias))``, in
  [lb, 0);
- Kimi-Linear / transformers: ``g = -exp(A_log) * softplus(f + dt_bias)``.

The output is an RMSNorm over each head (weight ``o_norm``, eps ``rms_norm_eps``) times
``sigmoid(gate)``, ``gate = g_proj(x)`` (K3's full-rank gate) or ``g_b_proj(g_a_proj(x))``,
all in float32 as fla's fused kernel and transformers compute it, then ``o_proj``.

Two evaluations of the same recurrence: :func:`recurrent_kda` runs it token by token
(decode), :func:`chunk_kda` in chunks of 64 (prefill), the WY form the references use:
within a chunk, with ``G`` the cumulative log-decay,

    T = (I + L)^-1 diag(beta)   L[i, j] = beta_i sum_d k_i k_j exp(G_i - G_j)  (j < i)
    w = T (exp(G) k), u = T v, v' = u - w S,  o = (exp(G) q) S + A_qk v'
    S <- diag(exp(G_last)) S + (exp(G_last - G) k)^T v'

The pairwise decays ``exp(G_i - G_j)`` go into matmuls as products of per-row and
per-column exponentials, factored so that no factor leaves float32's normal range
(see :func:`_intra_chunk`); where a 16-token stretch decays too steeply for that, they
are taken pairwise. So any gate works, bounded or not. All state and decay math is
float32.

Padding (``attention_mask`` 0) is removed, as Moonshot's code unpads with the mask
(``cu_seqlens``): the real tokens of each row are moved to its front in order, run, and
the outputs scattered back; padding outputs are zero and padding never enters the
conv or recurrent state. Left and right padding (and any 0/1 pattern) are supported;
transformers instead zeroes padded hidden states, which is the same for left padding
of a fresh sequence but lets right padding decay the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError

#: eps of the L2 norm of q and k (fla's l2norm kernel; transformers' kimi_linear)
L2NORM_EPS = 1e-6
#: sub-block of the intra-chunk decay factorisation (see the module docstring)
SUB_BLOCK = 16
#: elements of the per-sub-block pairwise decay tensor computed at once (~64 MiB fp32)
PAIRWISE_BUDGET = 1 << 24
#: largest log-decay spread a factor exp(+-spread) may span: e^80 and e^-80 stay normal
#: float32 numbers (e^88.7 overflows, e^-87.3 is the smallest normal)
SAFE_SPREAD = 80.0

P = "linear_attention."


@dataclass(frozen=True)
class KDASettings:
    """What a KDA layer needs besides its weights (the decoder builds it from config).

    num_heads: the model's KDA heads (a tensor-parallel rank runs the heads its q_proj
    rows hold); lower_bound: K3's ``gate_lower_bound`` (None: the softplus gate)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    lower_bound: float | None
    rms_eps: float
    chunk_size: int = 64

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "conv_kernel", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"KDA settings: {name} must be a positive integer, got {v!r}.")
        if self.chunk_size % SUB_BLOCK:
            raise ConfigError(
                f"KDA settings: chunk_size must be a multiple of {SUB_BLOCK}, got "
                f"{self.chunk_size}."
            )
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise ConfigError(
                f"KDA settings: gate_lower_bound must be negative (a log-decay), got "
                f"{self.lower_bound!r}."
            )


@dataclass
class KDAState:
    """A KDA layer's cache for one rank: the last ``conv_kernel - 1`` inputs of each short
    convolution (``q_conv`` / ``k_conv`` / ``v_conv`` [B, channels, K-1], the projection
    outputs' dtype) and the recurrent state [B, heads, head_dim, head_dim] float32.
    Empty until the first call; :func:`kda_attention` replaces the tensors after every
    call (the object is updated in place)."""

    q_conv: torch.Tensor | None = None
    k_conv: torch.Tensor | None = None
    v_conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q_conv, self.k_conv, self.v_conv, self.recurrent) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def empty(self) -> bool:
        return self.recurrent is None


# -- pieces ----------------------------------------------------------------------------
def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, float32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def forget_gate(
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    where: str = "KDA",
) -> torch.Tensor:
    """Log-decay ``g`` [..., H, D] float32 from the gate projection ``f`` [..., H, D].

    ``a_log``: one entry per head; a longer vector (the release pads it) uses its first H
    entries, transformers' [1, 1, H, 1] is flattened. ``dt_bias``: [H * D]."""
    h, d = f.shape[-2:]
    a = a_log.reshape(-1)
    if a.numel() < h:
        raise CheckpointError(
            f"{where}: A_log has {a.numel()} entries for {h} heads; it needs one per head "
            "(the first num_heads entries are used)."
        )
    if dt_bias.numel() != h * d:
        raise CheckpointError(
            f"{where}: dt_bias has {dt_bias.numel()} entries, expected heads x head_dim = "
            f"{h} x {d} = {h * d}."
        )
    rate = a[:h].float().exp()[:, None]  # [H, 1]
    x = f.float() + dt_bias.float().view(h, d)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution + SiLU: ``x`` [B, T, C], ``weight`` [C, 1, K] (or
    [C, K]), ``state`` [B, C, K-1] (the inputs before ``x``; None: zeros). Returns
    ``(y [B, T, C] in x's dtype, new state [B, C, K-1])``: the last K-1 inputs, or with
    ``lengths`` [B] those before position ``lengths[b]`` of row b (its real tokens are
    its first ``lengths[b]``). Math in float32."""
    b, t, c = x.shape
    kw = weight.reshape(c, -1)
    k = kw.shape[1]
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(b, c, k - 1)
    full = torch.cat((state.to(x.dtype), xt), dim=-1)  # [B, C, K-1+T]
    if t == 1:  # decode: one dot product per channel
        y = (full.float() * kw.float()).sum(-1, keepdim=True)
    else:
        y = F.conv1d(full.float(), kw.float().unsqueeze(1), groups=c)
    y = F.silu(y).transpose(1, 2).to(x.dtype)
    if lengths is None:
        new = full[..., t:]
    else:
        idx = lengths.view(b, 1, 1) + torch.arange(k - 1, device=x.device).view(1, 1, -1)
        new = full.gather(2, idx.expand(b, c, k - 1))
    return y, new.contiguous()


def gated_rms_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``rmsnorm(o) * weight * sigmoid(gate)`` over the last dim, float32."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() * torch.sigmoid(gate.float())


# -- the delta rule --------------------------------------------------------------------
def _inputs(q, k, v, g, beta, scale, initial_state):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or g.shape != q.shape:
        raise ValueError(
            f"KDA: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
            f"{tuple(g.shape)} must be [B, T, H, D] alike"
        )
    if beta.shape != (b, t, h):
        raise ValueError(f"KDA: beta {tuple(beta.shape)} must be [B, T, H] = {(b, t, h)}")
    scale = dk**-0.5 if scale is None else scale
    if initial_state is None:
        s = q.new_zeros(b, h, dk, dv, dtype=torch.float32)
    else:
        if initial_state.shape != (b, h, dk, dv):
            raise ValueError(
                f"KDA: initial state {tuple(initial_state.shape)} must be {(b, h, dk, dv)}"
            )
        s = initial_state.float()
    return scale, s


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token. q, k, g [B, T, H, K], v [B, T, H, V], beta
    [B, T, H], state [B, H, K, V]; q and k as given (normalise them first). Returns
    ``(o [B, T, H, V] float32, final state float32)``."""
    scale, s = _inputs(q, k, v, g, beta, scale, initial_state)
    qf, kf, vf = q.float() * scale, k.float(), v.float()
    decay, bf = g.float().exp(), beta.float()
    outs = []
    for i in range(q.shape[1]):
        k_i = kf[:, i]
        s = s * decay[:, i, :, :, None]
        err = vf[:, i] - torch.einsum("bhk,bhkv->bhv", k_i, s)
        s = s + torch.einsum("bhk,bhv->bhkv", k_i, err * bf[:, i, :, None])
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, i], s))
    o = torch.stack(outs, dim=1) if outs else vf.new_zeros(vf.shape)
    return o, s


def _intra_chunk(q, k, v, g, beta):
    """Per chunk (inputs [..., C, D], ``...`` = batch, head, chunk; ``g`` already the
    in-chunk cumsum): ``(w, u, qg, kd, decay_last, a_qk)`` of the module docstring.

    ``exp(G_i - G_j)`` (j <= i) is a product ``exp(G_i - R) exp(R - G_j)`` only where
    neither factor can leave float32's normal range: through the chunk start (R = 0) when
    every chunk's decay spread is below :data:`SAFE_SPREAD`; otherwise, between 16-token
    sub-blocks, through the start of the row's block and the end of the column's (three
    factors, each <= 1), and inside a sub-block through its first position when its
    spread is safe, pairwise when not (any gate, bounded or not)."""
    c, dk = k.shape[-2:]
    lead = k.shape[:-2]
    idx = torch.arange(c, device=k.device)
    eg = g.exp()
    if float(-g[..., -1, :].detach().min()) < SAFE_SPREAD:
        kc = k * (-g).exp()  # <= e^SAFE_SPREAD
        a_kk = (k * eg) @ kc.transpose(-1, -2)
        a_qk = (q * eg) @ kc.transpose(-1, -2)
    else:
        nb = c // SUB_BLOCK
        blk = lambda x: x.reshape(*lead, nb, SUB_BLOCK, x.shape[-1])  # noqa: E731
        kb, qb, gb = blk(k), blk(q), blk(g)
        end = gb[..., -1, :]  # [..., nb, D]: G at each block's last token
        start = torch.cat((torch.zeros_like(end[..., :1, :]), end[..., :-1, :]), dim=-2)
        row = (gb - start.unsqueeze(-2)).exp()  # rows i vs their block's start, <= 1
        col = kb * (end.unsqueeze(-2) - gb).exp()  # columns j vs their block's end, <= 1
        # block pairs (bi > bj): exp(start_bi - end_bj) <= 1; other pairs are masked below
        pair = (start.unsqueeze(-2) - end.unsqueeze(-3)).clamp(max=0).exp()  # [.., nb, nb, D]
        cols = (pair.unsqueeze(-2) * col.unsqueeze(-4)).reshape(*lead, nb, c, dk)
        a_kk = ((kb * row) @ cols.transpose(-1, -2)).reshape(*lead, c, c)
        a_qk = ((qb * row) @ cols.transpose(-1, -2)).reshape(*lead, c, c)
        blk_id = idx // SUB_BLOCK
        later = blk_id[:, None] > blk_id[None, :]
        a_kk = a_kk.masked_fill(~later, 0)
        a_qk = a_qk.masked_fill(~later, 0)
        # inside a sub-block
        first = gb[..., :1, :]
        if float((first - gb[..., -1:, :]).detach().max()) < SAFE_SPREAD:
            kf = kb * (first - gb).exp()  # <= e^SAFE_SPREAD
            rf = (gb - first).exp()
            d_kk = (kb * rf) @ kf.transpose(-1, -2)  # [..., nb, S, S]
            d_qk = (qb * rf) @ kf.transpose(-1, -2)
        else:
            upper = torch.ones(SUB_BLOCK, SUB_BLOCK, dtype=torch.bool, device=k.device).triu(1)
            diff = gb.unsqueeze(-2) - gb.unsqueeze(-3)  # [..., nb, S(i), S(j), D]
            e = diff.masked_fill(upper[..., None], float("-inf")).exp()
            d_kk = (kb.unsqueeze(-2) * kb.unsqueeze(-3) * e).sum(-1)
            d_qk = (qb.unsqueeze(-2) * kb.unsqueeze(-3) * e).sum(-1)
        kk = a_kk.view(*lead, nb, SUB_BLOCK, nb, SUB_BLOCK)
        qk = a_qk.view(*lead, nb, SUB_BLOCK, nb, SUB_BLOCK)
        for r in range(nb):
            kk[..., r, :, r, :] = d_kk[..., r, :, :]
            qk[..., r, :, r, :] = d_qk[..., r, :, :]
    a_qk = a_qk.masked_fill(idx[:, None] < idx[None, :], 0)  # j <= i
    lmat = a_kk.masked_fill(idx[:, None] <= idx[None, :], 0) * beta.unsqueeze(-1)  # j < i
    eye = torch.eye(c, dtype=lmat.dtype, device=k.device)
    rhs = torch.cat((eg * k, v), dim=-1) * beta.unsqueeze(-1)
    wu = torch.linalg.solve_triangular(lmat + eye, rhs, upper=False, unitriangular=True)
    w, u = wu.split([dk, v.shape[-1]], dim=-1)
    last = g[..., -1:, :]
    return w, u, q * eg, k * (last - g).exp(), last.squeeze(-2).exp(), a_qk


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks (same arguments and results as
    :func:`recurrent_kda`). T need not be a multiple of ``chunk_size``: the tail is padded
    with tokens whose g = 0 and beta = 0, which leave the state as it is."""
    scale, s = _inputs(q, k, v, g, beta, scale, initial_state)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if t == 0:
        return v.new_zeros(b, 0, h, dv, dtype=torch.float32), s
    c = min(chunk_size, -(-t // SUB_BLOCK) * SUB_BLOCK)
    pad = -t % c
    n = (t + pad) // c

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...] float32
        x = x.float()
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(b, n, c, h, *x.shape[3:]).movedim(3, 1)

    qc, kc, vc, gc = chunks(q) * scale, chunks(k), chunks(v), chunks(g).cumsum(-2)
    bc = chunks(beta)
    # intra-chunk parts for as many chunks at a time as the pairwise budget allows
    per_chunk = b * h * c * SUB_BLOCK * dk
    step = max(1, PAIRWISE_BUDGET // per_chunk)
    parts = [
        _intra_chunk(*(x[:, :, i : i + step] for x in (qc, kc, vc, gc, bc)))
        for i in range(0, n, step)
    ]
    w, u, qg, kd, dl, a_qk = (torch.cat(p, dim=2) for p in zip(*parts, strict=True))
    o = vc.new_empty(b, h, n, c, dv)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        o[:, :, i] = qg[:, :, i] @ s + a_qk[:, :, i] @ v_new
        s = s * dl[:, :, i, :, None] + kd[:, :, i].transpose(-1, -2) @ v_new
    o = o.movedim(1, 3).reshape(b, n * c, h, dv)[:, :t]
    return o, s


# -- the layer -------------------------------------------------------------------------
Linear = Callable[[Any, str, torch.Tensor], torch.Tensor]


def _compact(attention_mask: torch.Tensor | None, b: int, s: int, where: str):
    """``(order [B, S], lengths [B])`` moving each row's real tokens to its front, or
    None when every token is real."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] < s:
        raise ConfigError(
            f"{where}: attention_mask {tuple(attention_mask.shape)} must be [batch, tokens] "
            f"with batch {b} and at least the {s} new tokens (1 = real, 0 = padding)."
        )
    m = attention_mask[:, -s:].to(torch.bool)
    if bool(m.all()):
        return None
    order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)
    return order, m.sum(1)


def kda_attention(
    ts: KDASettings,
    lin: Linear,
    w: Any,
    h: torch.Tensor,
    attention_mask: torch.Tensor | None,
    state: KDAState | None,
) -> torch.Tensor:
    """One KDA layer's attention output (o_proj's, [B, S, hidden]; a partial sum on a
    tensor-parallel rank). ``h``: the input-normed hidden state [B, S, hidden];
    ``attention_mask``: [B, S] (or [B, past + S], its last S columns are used) 1 = real,
    0 = padding (see the module docstring), or None; ``state``: None (no cache) or the
    layer's :class:`KDAState`, read and updated. Heads come from q_proj's rows // head_dim,
    so a rank holding a head slice (with its conv channels, dt_bias, A_log entries first)
    runs the same code. Every projection goes through ``lin``."""
    b, s, _ = h.shape
    d = ts.head_dim
    where = "KDA layer"
    comp = _compact(attention_mask, b, s, where)
    lengths = None
    if comp is not None:
        order, lengths = comp
        valid = torch.arange(s, device=h.device)[None, :] < lengths[:, None]  # [B, S]
        h = h.gather(1, order[..., None].expand_as(h)) * valid[..., None].to(h.dtype)

    q = lin(w, P + "q_proj", h)
    if q.shape[-1] % d:
        raise CheckpointError(
            f"{where}: q_proj gives {q.shape[-1]} features, not a multiple of head_dim {d}."
        )
    nh = q.shape[-1] // d
    if nh > ts.num_heads:
        raise CheckpointError(
            f"{where}: q_proj holds {nh} heads of {d}, more than the config's "
            f"{ts.num_heads} KDA heads."
        )
    k = lin(w, P + "k_proj", h)
    v = lin(w, P + "v_proj", h)
    for name, x in (("k_proj", k), ("v_proj", v)):
        if x.shape[-1] != nh * d:
            raise CheckpointError(
                f"{where}: {name} gives {x.shape[-1]} features, q_proj {nh * d}; they must match."
            )
    st = state if state is not None and not state.empty else None
    if st is not None and st.recurrent.shape[0] != b:
        raise ConfigError(
            f"{where}: the cached state is for batch {st.recurrent.shape[0]}, the input has "
            f"{b} rows; use one KDAState per batch."
        )
    convs = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        wt = w.need(f"{P}{name}_conv1d")
        if wt.numel() != x.shape[-1] * ts.conv_kernel:
            raise CheckpointError(
                f"{where}: {name}_conv1d has shape {tuple(wt.shape)}, expected "
                f"[{x.shape[-1]}, 1, {ts.conv_kernel}] (channels, 1, short_conv_kernel_size)."
            )
        prev = getattr(st, f"{name}_conv") if st is not None else None
        convs.append(short_conv(x, wt, prev, lengths))
    (q, q_conv), (k, k_conv), (v, v_conv) = convs

    f = lin(w, P + "f_b_proj", lin(w, P + "f_a_proj", h))
    g = forget_gate(
        f.view(b, s, nh, d),
        w.need(P + "A_log"),
        w.need(P + "dt_bias"),
        ts.lower_bound,
        where,
    )
    beta = torch.sigmoid(lin(w, P + "b_proj", h).float())
    if beta.shape[-1] != nh:
        raise CheckpointError(f"{where}: b_proj gives {beta.shape[-1]} gates for {nh} heads.")
    if comp is not None:  # padding (now at each row's end) neither decays nor writes
        g = g * valid[..., None, None]
        beta = beta * valid[..., None]
    qn = l2norm(q.view(b, s, nh, d))
    kn = l2norm(k.view(b, s, nh, d))
    h0 = st.recurrent if st is not None else None
    run = recurrent_kda if s == 1 else chunk_kda
    kw = {} if s == 1 else {"chunk_size": ts.chunk_size}
    o, s_new = run(qn, kn, v.view(b, s, nh, d), g, beta, initial_state=h0, **kw)

    if P + "g_proj" in w:
        gate = lin(w, P + "g_proj", h)
    else:
        gate = lin(w, P + "g_b_proj", lin(w, P + "g_a_proj", h))
    y = gated_rms_norm(o, gate.view(b, s, nh, d), w.need("norms.o_norm"), ts.rms_eps)
    if comp is not None:
        y = y * valid[..., None, None]
    out = lin(w, P + "o_proj", y.reshape(b, s, nh * d).to(h.dtype))
    if comp is not None:
        out = torch.zeros_like(out).scatter_(1, order[..., None].expand_as(out), out)
    if state is not None:
        state.q_conv, state.k_conv, state.v_conv = q_conv, k_conv, v_conv
        state.recurrent = s_new
    return out
