"""Moonshot's Kimi-K3 modeling code as an oracle, runnable on a CPU without fla's kernels.

The code under test is ours; the oracle is code we did not write:

- Moonshot's ``configuration_kimi_k3.py``, ``modeling_kimi_linear.py`` and
  ``modeling_kimi_k3.py`` as published in ``llmcompressor==0.14.0.1``
  (``llmcompressor/modeling/kimi_k3/``), installed with ``pip install --no-deps`` (it pins
  transformers<=5.17). The three files are executed from their installed paths into the
  synthetic package ``_moonshot_k3``; ``llmcompressor/__init__.py`` never runs.
- flash-linear-attention ``fla-core==0.6.0`` (installed ``--no-deps``), whose pure-torch
  references stand in for the Triton kernels Moonshot's code calls. ``fla`` itself is never
  imported (its ``__init__`` needs triton): the references are read from fla's files.

What replaces each fla name the modeling code imports (``fla.*`` exists only while the
modeling file executes; ``sys.modules`` is restored afterwards):

- ``fla.ops.kda.chunk_kda`` -> ``naive_chunk_kda`` (``fla/ops/kda/naive.py``, loaded by file
  path). The wrapper does what ``chunk_kda``'s flags ask before calling it, each step with
  fla's own code where fla has it: the gate with ``naive_kda_lowerbound_gate`` (when
  ``lower_bound`` is set) or ``naive_kda_gate`` (both from ``fla/ops/kda/gate.py``);
  ``beta`` through ``torch.sigmoid`` in float32 (``fused_beta_sigmoid``, a one-line kernel
  with no reference); q and k L2-normalised as fla's ``l2norm_fwd`` kernel does (no torch
  reference in fla: ``x / sqrt(sum(x**2) + 1e-6)`` in float32, the kernel's formula and
  eps); T padded with zero tokens to a multiple of 64 (``naive_chunk_kda`` asserts it; a
  token with g = 0 and beta = 0 leaves the state and the other outputs unchanged);
  ``cu_seqlens`` run one sequence at a time; ``transpose_state_layout`` (renamed
  ``state_v_first`` in fla 0.6.0) states [N, H, V, K] transposed to the naive [N, H, K, V]
  and back.
- ``fla.ops.kda.fused_recurrent_kda`` -> ``naive_recurrent_kda``, wrapped the same way.
- ``fla.modules.ShortConvolution``: fla has no torch reference. It is an ``nn.Conv1d``
  (depthwise, ``padding=K-1``) documented as a causal depthwise convolution with optional
  SiLU and a cache of shape [N, D, W] holding the last W = kernel_size inputs; the
  stand-in is that ``nn.Conv1d`` subclass with the same parameters, running
  ``F.conv1d`` with its own weight over [cache | x] per sequence, SiLU, and returning the
  last W inputs as the new cache.
- ``fla.modules.FusedRMSNormGated`` (``activation="sigmoid"``): fla's torch reference of
  the norm is ``rms_norm_ref`` (``fla/modules/norm/layernorm.py``); the stand-in applies it
  in float32 and multiplies by ``sigmoid(g)`` in float32, then casts to x's dtype, which is
  what the fused kernel (``layer_norm_gated_fwd_kernel``) computes.
- ``fla.ops.utils.index.prepare_lens_from_mask`` / ``prepare_cu_seqlens_from_mask`` /
  ``prepare_cu_seqlens_from_lens``: fla's own torch functions, read from
  ``fla/ops/utils/index.py``; ``fla.utils.tensor_cache`` (a last-result memoizer) is the
  identity.

Patches to Moonshot's code for transformers 5.24 / a CPU, each the minimum:

- ``llmcompressor.modeling.moe.context.get_calibrate_all_experts_flag`` is a stub
  returning False (inference routing, ``moe_infer``), the only llmcompressor name used.
- ``torch.compile`` is the identity while ``modeling_kimi_k3.py`` executes: its
  ``get_rope_shape`` (pos-emb interpolation) is decorated with it, and inductor on a CPU
  runner is neither wanted nor reliable; the function body is unchanged.
- the vision config's ``_attn_implementation`` is forced to ``"eager"`` (its default
  ``flash_attention_2`` calls flash-attn's varlen kernel); the text model falls back to
  eager by itself. ``config.json`` does not keep this field (transformers drops it), so
  :func:`build_oracle` sets it after loading.

Checkpoints (:func:`build_kimi_k3`) store ``A_log`` padded with zeros to
``max(num_heads, head_dim)`` entries, as the release does ([128] for 96 heads); Moonshot's
module holds [num_heads], so :func:`build_oracle` narrows it back.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import json
import math
import sys
import types
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

PKG = "_moonshot_k3"
MODULE_FILES = ("configuration_kimi_k3", "modeling_kimi_linear", "modeling_kimi_k3")
#: fla's l2norm kernel eps (fla/modules/norm/l2norm.py, l2norm_fwd's default)
L2NORM_EPS = 1e-6


def _package_dir(name: str) -> Path:
    """Directory of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"'{name}' is not installed; the oracle needs it: pip install einops && "
            "pip install --no-deps fla-core==0.6.0 llmcompressor==0.14.0.1"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _functions_from(path: Path, names: tuple[str, ...], env: dict) -> dict:
    """The named top-level functions of a file whose imports we cannot run (triton),
    executed from their own source in ``env``; decorators are evaluated in ``env``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    if missing:
        raise ImportError(f"{path}: no function(s) {sorted(missing)}")
    ns = dict(env)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
    return {n: ns[n] for n in names}


@cache
def fla_refs() -> types.SimpleNamespace:
    """fla's pure-torch references: ``naive_recurrent_kda``, ``naive_chunk_kda``,
    ``naive_kda_gate``, ``naive_kda_lowerbound_gate``, ``rms_norm_ref`` and the mask
    helpers of ``fla/ops/utils/index.py``."""
    root = _package_dir("fla")
    naive = _load_file("_fla_kda_naive", root / "ops" / "kda" / "naive.py")
    env = {"torch": torch, "F": F, "tensor_cache": lambda f: f}
    gate = _functions_from(
        root / "ops" / "kda" / "gate.py", ("naive_kda_gate", "naive_kda_lowerbound_gate"), env
    )
    norm = _functions_from(root / "modules" / "norm" / "layernorm.py", ("rms_norm_ref",), env)
    index = _functions_from(
        root / "ops" / "utils" / "index.py",
        ("prepare_lens_from_mask", "prepare_cu_seqlens_from_lens", "prepare_cu_seqlens_from_mask"),
        env,
    )
    return types.SimpleNamespace(
        naive_recurrent_kda=naive.naive_recurrent_kda,
        naive_chunk_kda=naive.naive_chunk_kda,
        **gate,
        **norm,
        **index,
    )


# -- stand-ins for fla's kernels ------------------------------------------------------
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _kda_reference(naive_fn, chunked: bool):
    def run(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        safe_gate=False,
        lower_bound=None,
        cu_seqlens=None,
        A_log=None,
        dt_bias=None,
        transpose_state_layout=False,
        state_v_first=False,
        allow_neg_eigval=False,
        **unused,
    ):
        refs = fla_refs()
        if allow_neg_eigval or unused:
            raise NotImplementedError(f"oracle KDA stand-in: unsupported {sorted(unused)}")
        v_first = transpose_state_layout or state_v_first
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        if use_gate_in_kernel:
            if lower_bound is not None:
                g = refs.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
            else:
                g = refs.naive_kda_gate(g, A_log, dt_bias)
        if use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.float())
        if initial_state is not None and v_first:
            initial_state = initial_state.transpose(-1, -2)
        if cu_seqlens is None:
            bounds = None
            n = q.shape[0]
        else:
            if q.shape[0] != 1:
                raise ValueError("cu_seqlens needs batch 1 (packed sequences)")
            bounds = cu_seqlens.tolist()
            n = len(bounds) - 1
        outs, states = [], []
        for i in range(n):
            if bounds is None:
                parts = [t[i : i + 1] for t in (q, k, v, g, beta)]
            else:
                parts = [t[:, bounds[i] : bounds[i + 1]] for t in (q, k, v, g, beta)]
            h0 = None if initial_state is None else initial_state[i : i + 1]
            t = parts[0].shape[1]
            if chunked and t % 64:
                pad = 64 - t % 64
                parts = [F.pad(p, (0, 0) * (p.dim() - 2) + (0, pad)) for p in parts]
            o, s = naive_fn(*parts, scale=scale, initial_state=h0, output_final_state=True)
            outs.append(o[:, :t])
            states.append(s)
        o = torch.cat(outs, dim=0 if bounds is None else 1)
        final = torch.cat(states)
        if v_first:
            final = final.transpose(-1, -2)
        return o, (final.contiguous() if output_final_state else None)

    return run


class ShortConvolutionRef(nn.Conv1d):
    """Stand-in for ``fla.modules.ShortConvolution`` (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        backend: str | None = "triton",
        device=None,
        dtype=None,
        **kwargs,
    ):
        super().__init__(
            hidden_size,
            hidden_size,
            kernel_size,
            padding=kernel_size - 1,
            groups=hidden_size,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(
        self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None
    ):
        if residual is not None:
            raise NotImplementedError("oracle ShortConvolution: residual is not used by K3")
        if mask is not None:
            x = x * mask.unsqueeze(-1)
        w_len = self.kernel_size[0]
        if cu_seqlens is None:
            seqs = [x[i] for i in range(x.shape[0])]
        else:
            b = cu_seqlens.tolist()
            seqs = [x[0, b[i] : b[i + 1]] for i in range(len(b) - 1)]
        ys, states = [], []
        for i, s in enumerate(seqs):  # s: [T, D]
            prev = cache[i] if cache is not None else s.new_zeros(self.hidden_size, w_len)  # [D, W]
            full = torch.cat((prev.to(s.dtype), s.t()), dim=-1)  # [D, W + T]
            y = F.conv1d(full[None], self.weight, self.bias, groups=self.hidden_size)[0, :, 1:]
            if self.activation in ("silu", "swish"):
                y = F.silu(y)
            ys.append(y.t())
            states.append(full[:, -w_len:])
        y = torch.stack(ys) if cu_seqlens is None else torch.cat(ys)[None]
        return y, (torch.stack(states) if output_final_state else None)


class FusedRMSNormGatedRef(nn.Module):
    """Stand-in for ``fla.modules.FusedRMSNormGated`` (see the module docstring)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, activation="swish", **kw):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("oracle FusedRMSNormGated: no residual in K3")
        w = self.weight.float() if self.weight is not None else None
        y = fla_refs().rms_norm_ref(x.float(), w, None, eps=self.eps, upcast=True)
        gf = g.float()
        y = y * (torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf))
        return y.to(x.dtype)


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so submodules can be imported from it
    vars(m).update(attrs)
    return m


@contextlib.contextmanager
def temporary_modules(mods: dict[str, types.ModuleType], also=()):
    """``sys.modules`` holds ``mods`` inside the block; afterwards those names and the
    names in ``also`` (modules the block itself registers) are as they were."""
    saved = {n: sys.modules.get(n) for n in [*mods, *also]}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@contextlib.contextmanager
def _no_torch_compile():
    real = torch.compile

    def identity(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = real


@cache
def load() -> types.ModuleType:
    """Moonshot's three modules in one namespace (the package ``_moonshot_k3``):
    ``KimiLinearConfig``, ``KimiK3Config``, ``KimiK3VisionConfig``,
    ``KimiLinearForCausalLM``, ``KimiDeltaAttention``, ``KimiK3ForConditionalGeneration``, ...
    """
    pkg_dir = _package_dir("llmcompressor") / "modeling" / "kimi_k3"
    refs = fla_refs()
    fla = {
        "fla": _module("fla"),
        "fla.modules": _module(
            "fla.modules",
            FusedRMSNormGated=FusedRMSNormGatedRef,
            ShortConvolution=ShortConvolutionRef,
        ),
        "fla.ops": _module("fla.ops"),
        "fla.ops.kda": _module(
            "fla.ops.kda",
            chunk_kda=_kda_reference(refs.naive_chunk_kda, chunked=True),
            fused_recurrent_kda=_kda_reference(refs.naive_recurrent_kda, chunked=False),
        ),
        "fla.ops.utils": _module("fla.ops.utils"),
        "fla.ops.utils.index": _module(
            "fla.ops.utils.index",
            prepare_lens_from_mask=refs.prepare_lens_from_mask,
            prepare_cu_seqlens_from_mask=refs.prepare_cu_seqlens_from_mask,
        ),
        "fla.utils": _module("fla.utils", tensor_cache=lambda f: f),
        "llmcompressor": _module("llmcompressor"),
        "llmcompressor.modeling": _module("llmcompressor.modeling"),
        "llmcompressor.modeling.moe": _module("llmcompressor.modeling.moe"),
        "llmcompressor.modeling.moe.context": _module(
            "llmcompressor.modeling.moe.context", get_calibrate_all_experts_flag=lambda: False
        ),
    }
    pkg = types.ModuleType(PKG)
    pkg.__path__ = [str(pkg_dir)]
    pkg.__package__ = PKG
    sys.modules[PKG] = pkg
    with temporary_modules(fla), _no_torch_compile():
        for name in MODULE_FILES:
            full = f"{PKG}.{name}"
            spec = importlib.util.spec_from_file_location(full, pkg_dir / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            spec.loader.exec_module(mod)
            setattr(pkg, name, mod)
    for name in MODULE_FILES:
        for k, v in vars(getattr(pkg, name)).items():
            if not k.startswith("__"):
                setattr(pkg, k, v)
    return pkg


# -- tiny random K3 checkpoints -------------------------------------------------------
def text_config(**overrides) -> dict:
    """The tiny K3 text config (``model_type: kimi_linear``); ``overrides`` replace keys,
    ``linear_attn_config`` entries are merged. Changing ``num_hidden_layers`` alone puts an
    MLA layer at every third position (1-based 3, 6, ...)."""
    n = int(overrides.get("num_hidden_layers", 6))
    full = [i for i in range(1, n + 1) if i % 3 == 0]
    lac = {
        "kda_layers": [i for i in range(1, n + 1) if i not in full],
        "full_attn_layers": full,
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    }
    lac.update(overrides.pop("linear_attn_config", None) or {})
    cfg = {
        "model_type": "kimi_linear",
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": n,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 48,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "linear_attn_config": lac,
        "attn_res_block_size": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    return cfg


def vision_config(text_hidden_size: int = 64) -> dict:
    """A tiny MoonViT3d + patchmergerv2 projector (``KimiK3VisionConfig`` keys)."""
    return {
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 2,
        "vt_hidden_size": 32,
        "vt_intermediate_size": 64,
        "qkv_hidden_size": 48,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": 32,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden_size,
    }


def _a_log_len(lac: dict) -> int:
    return max(int(lac["num_heads"]), int(lac["head_dim"]))


NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, FusedRMSNormGatedRef)


def randomize(model: nn.Module, seed: int, std: float = 0.08) -> None:
    """Every parameter and persistent buffer drawn from a seeded normal: norm weights
    around 1, everything else (biases, A_log, dt_bias, conv weights, router bias) around
    0, all with ``std``. The release's own init is not used."""
    gen = torch.Generator().manual_seed(seed)
    norm_weights = set()
    for mname, m in model.named_modules():
        if isinstance(m, NORM_TYPES) or type(m).__name__ == "KimiRMSNorm":
            norm_weights.add(f"{mname}.weight" if mname else "weight")
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if not t.is_floating_point():
                continue
            vals = torch.randn(t.shape, generator=gen, dtype=torch.float32) * std
            if name in norm_weights:
                vals += 1.0
            t.copy_(vals)


def _k3_config_dict(mod, text: dict, vision: dict | None) -> dict:
    kw = {"text_config": text, "media_placeholder_token_id": text["vocab_size"] - 1}
    if vision is not None:
        kw["vision_config"] = vision
    cfg = mod.KimiK3Config(**kw)
    d = cfg.to_dict()
    for key in ("text_config", "vision_config"):
        sub = getattr(cfg, key)
        if sub is not None and not isinstance(d.get(key), dict):
            d[key] = sub.to_dict()
    d["model_type"] = "kimi_k3"
    d["architectures"] = ["KimiK3ForConditionalGeneration"]
    if vision is None:
        d.pop("vision_config", None)
    return d


def build_kimi_k3(tmp_path, *, seed: int = 0, vision: bool = True, **text_overrides) -> Path:
    """A tiny random Kimi-K3 checkpoint in ``tmp_path / "kimi_k3"`` (or ``"kimi_k3_text"``
    without vision): ``config.json`` (``model_type: kimi_k3``, ``text_config``,
    ``vision_config`` as Moonshot's config classes serialize them) and ``model.safetensors``
    (float32) with the model's state-dict names; ``A_log`` padded to
    ``max(num_heads, head_dim)`` entries. ``vision=False`` leaves out ``vision_config`` and
    the ``vision_tower.*`` / ``mm_projector.*`` tensors. Returns the directory."""
    mod = load()
    text = text_config(**text_overrides)
    vis = vision_config(text["hidden_size"]) if vision else None
    out = Path(tmp_path) / ("kimi_k3" if vision else "kimi_k3_text")
    out.mkdir(parents=True, exist_ok=True)
    cfg = _k3_config_dict(mod, text, vis)
    model = _instantiate(mod, cfg)
    randomize(model, seed)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if not vision:
        sd = {"language_model." + k: v for k, v in sd.items()}
    n_pad = _a_log_len(text["linear_attn_config"])
    for k in [k for k in sd if k.endswith(".A_log")]:
        a = sd[k].reshape(-1)
        sd[k] = torch.cat((a, a.new_zeros(n_pad - a.numel())))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _instantiate(mod, cfg: dict) -> nn.Module:
    """Moonshot's model for a config dict, float32: the K3 model with a vision config,
    else its text model (``KimiLinearForCausalLM``)."""
    cfg = copy.deepcopy(cfg)
    torch.manual_seed(0)  # modules' own init draws from the global generator
    if cfg.get("vision_config") is not None:
        config = mod.KimiK3Config(**cfg)
        config.vision_config._attn_implementation = "eager"
        model = mod.KimiK3ForConditionalGeneration(config)
    else:
        config = mod.KimiLinearConfig(**cfg["text_config"])
        model = mod.KimiLinearForCausalLM(config)
    return model.float().eval()


def build_oracle(path) -> nn.Module:
    """Moonshot's model loaded from a :func:`build_kimi_k3` directory, float32, eval mode:
    ``KimiK3ForConditionalGeneration`` when the config has a ``vision_config``, else
    ``KimiLinearForCausalLM`` (the checkpoint's ``language_model.`` prefix dropped). Both
    take ``input_ids`` / ``attention_mask`` and return ``.logits``. ``A_log`` is narrowed
    to the module's ``num_heads`` entries. Every tensor must load (strict)."""
    path = Path(path)
    mod = load()
    cfg = json.loads((path / "config.json").read_text())
    model = _instantiate(mod, cfg)
    sd = load_file(str(path / "model.safetensors"))
    if cfg.get("vision_config") is None:
        pre = "language_model."
        sd = {k[len(pre) :] if k.startswith(pre) else k: v for k, v in sd.items()}
    own = model.state_dict()
    for k in [k for k in sd if k.endswith(".A_log") and k in own]:
        sd[k] = sd[k][: own[k].numel()].view_as(own[k])
    model.load_state_dict(sd, strict=True)
    return model.float().eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float64); 0 when both are 0."""
    a, b = a.double(), b.double()
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
