"""``Runtime``: our own forward pass, executed from a weight source one unit at a time.

Why not transformers: the runtime must run from shards that never form a whole model
(3 T parameters), layer by layer, with hooks where calibration needs them; transformers
is only the test oracle. The forward is split into the pieces calibration drives:

    h = rt.embed(input_ids, pixel_values=..., image_grid_thw=...)     # [B, S, H]
    for i in range(rt.num_layers):
        h = rt.run_layer(i, h, position_ids, attention_mask)
    logits = rt.head(h)                                             # [B, S, V] float32

Each piece fetches its unit's weights from a :class:`UnitLoader` (current unit kept,
next unit prefetched on a background thread) and holds them only while it runs.

Quantized checkpoints: weights come back dequantized from the source; the input of
every Linear the ``quantization_config`` quantizes (``input_activations``: W8A8, FP8,
dynamic per token / per group or static per tensor) is fake-quantized exactly as
compressed-tensors' ``forward_quantize`` does (:mod:`k3convert.quant.activations`), on
the tensor shape transformers hands that Linear. That shape matters, because the
``token`` strategy reduces over every dim but the first two:

- attention q/k/v/o, MLA q_a/q_b/kv_a, dense MLP and shared experts see
  ``[batch, seq, in]``: one scale per token;
- MLA ``kv_b_proj`` sees the latent as ``[batch, 1, seq, kv_lora_rank]`` (transformers'
  ``expand_kv``): one scale per *sequence*;
- routed experts: transformers 5.24 fuses them into 3-D parameters that are not
  ``nn.Linear`` modules, so compressed-tensors attaches no input quantization to them
  (their weights are dequantized at load): by default the runtime leaves their inputs
  unquantized too. ``act_quant_experts=True`` quantizes them as serving kernels do
  instead (one scale per token row, group or the expert's own static ``input_scale``);
- routers run in float32 and are never activation-quantized.

``rt.act_quant = False`` (``k3convert forward --no-act-quant``) switches the activation
part off to isolate the weight error.

KV cache: a checkpoint whose quantization_config has a ``kv_cache_scheme`` (FP8 e4m3,
static, per tensor: what ``quantize --kv-cache fp8`` writes) carries per-layer
``self_attn.k_scale`` / ``v_scale``; with ``act_quant`` on, what enters the KV cache is
fake-quantized with them (GQA: K after k_norm and rope with k_scale, V with v_scale;
MLA: the normed latent and the roped shared key, both with k_scale, as vLLM's MLA
cache stores them), in the cache and no-cache paths alike (compressed-tensors quantizes
K / V at the cache update, which runs without a cache too). ``add_kv_hook`` observes
those tensors before quantization (what calibration needs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..arch import kv_cache_scheme_of, resolve, validate_source
from ..checkpoint.reader import Checkpoint
from ..device import resolve_device
from ..errors import CheckpointError, ConfigError, NonFiniteError
from ..formats.dtypes import FLOAT_DTYPES, SHORT_DTYPES
from ..quant.activations import ActivationSpec, activation_specs, fake_quant_activation
from ..quant.kvcache import check_scheme
from .cache import KVCache
from .decoder import (
    AttnResState,
    Step,
    TextSettings,
    as_attn_res,
    decoder_layer,
    layer_output,
    make_step,
    res_output,
    text_settings,
)
from .ops import LinearHook, rms_norm
from .source import Plan, UnitLoader, Weights, WeightSource, make_plan
from .vision import VisionSettings, encode_images, vision_settings
from .vision_k3 import VisionSettingsK3, encode_images_k3, vision_settings_k3

#: compute dtypes by either name (``bf16`` / ``bfloat16``)
DTYPES = {**SHORT_DTYPES, **FLOAT_DTYPES}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"compute dtype {dtype} is not supported; use fp32 or bf16.")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(
            f"compute dtype '{dtype}' is not known; use one of fp32, bf16, fp16."
        ) from None


@dataclass
class HookHandle:
    """Returned by :meth:`Runtime.add_hook` / :meth:`Runtime.add_kv_hook`; ``remove()``
    unregisters the hook."""

    runtime: Runtime
    entry: tuple | Callable
    kind: str = "_hooks"

    def remove(self) -> None:
        hooks = getattr(self.runtime, self.kind)
        if any(h is self.entry for h in hooks):
            hooks[:] = [h for h in hooks if h is not self.entry]


#: KV-cache observer: fn(layer, kind, tensor); kind "k" / "v" (GQA), "latent" / "k_rot" (MLA)
KVHook = Callable[[int, str, torch.Tensor], None]


def _matcher(match) -> Callable[[str], bool]:
    if match is None:
        return lambda n: True
    if isinstance(match, str):
        rx = re.compile(match)
        return lambda n: rx.search(n) is not None
    if callable(match):
        return match
    names = frozenset(match)
    return lambda n: n in names


class Runtime:
    """Forward pass of a llama / qwen / mixtral / qwen3_moe / deepseek_v3 / kimi_k2 /
    kimi_k25 model from ``source`` (anything with ``config``, ``names()``, ``get()``).

    device: a torch device string; dtype: compute dtype (weights are converted on load;
    norms, softmax, rotary and routers run in float32). prefetch: load the next unit on a
    background thread. resident: keep every unit once loaded (fast repeated forwards of a
    model that fits in memory); default streams.

    act_quant: fake-quantize Linear inputs as the checkpoint's ``quantization_config``
    says, and the KV cache with the ``kv_cache_scheme``'s scales (None: on when any Linear
    has ``input_activations`` or the config has a kv_cache_scheme); a plain attribute, so
    ``rt.act_quant = False`` switches both off between forwards. act_quant_experts: also
    quantize routed experts' inputs (off: as transformers 5.24, see the module doc).
    ``rt.act_specs`` maps each activation-quantized Linear's weight name to its spec;
    ``rt.kv_scheme`` is the kv_cache_scheme (or None), ``rt.kv_quant`` whether it applies.
    """

    def __init__(
        self,
        source: WeightSource,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        *,
        prefetch: bool = True,
        resident: bool = False,
        act_quant: bool | None = None,
        act_quant_experts: bool = False,
    ):
        self._setup(source, device, dtype, act_quant, act_quant_experts)
        self.loader = UnitLoader(
            source, self.plan, dtype=self.dtype, device=self.device, prefetch=prefetch,
            resident=resident, input_scales=self._static,
        )  # fmt: skip

    def _setup(self, source, device, dtype, act_quant, act_quant_experts) -> None:
        """Everything but the weight loader: the config, the plan of units, the checks."""
        self._hooks: list[tuple[Callable[[str], bool], LinearHook]] = []
        self._kv_hooks: list[KVHook] = []
        self._step_key: tuple | None = None
        self._step: Step | None = None
        self._step_refs: tuple = ()
        self.source = source
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype)
        raw = source.config
        where = f"{getattr(source, 'root', 'source')}/config.json"
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f"{where}: the weight source has no config; the runtime needs one.")
        self.arch, self.cfg = resolve(raw, where)
        text_raw = self.arch.text_raw(raw)
        self.text: TextSettings = text_settings(
            self.arch.name, _text_cfg(self.cfg), text_raw, where
        )
        self.vision: VisionSettings | VisionSettingsK3 | None = None
        if self.arch.vision == "moonvit":
            self.vision = vision_settings(raw, self.cfg, where)
        elif self.arch.vision == "moonvit3d" and self.cfg.vision is not None:  # None: text only
            self.vision = vision_settings_k3(raw, self.cfg, where)
        #: MoonViT3d widens each image's placeholder (expand_media); Moonshot zeroes the
        #: embeddings of this token id when it merges images in
        self._widens = self.arch.vision == "moonvit3d" and self.vision is not None
        self._pad_id = raw.get("pad_token_id", 0)
        # shapes against config.json and completeness: the same checks as every verb
        matched = validate_source(self.arch, self.cfg, source, where)
        self.plan: Plan = make_plan(
            self.cfg, matched, tied=bool(self.cfg.tie_word_embeddings), where=where
        )
        meta = getattr(source, "meta", None)
        emb = self.plan.units.get("embed", {}).get("embeddings.embed_tokens")
        #: the embedding's rows (what input ids index)
        self.vocab: int | None = (
            meta(emb.name).shape[0] if meta is not None and emb is not None else None
        )
        #: routed experts' weight names (left unquantized unless act_quant_experts)
        entries = [e for u in self.plan.units.values() for e in u.values()]
        self.routed_weights = frozenset(e.name for e in entries if e.role.expert is not None)
        self.act_specs: dict[str, ActivationSpec] = self._activation_specs(raw)
        #: the checkpoint's kv_cache_scheme (its scales checked by validate_source), or None
        self.kv_scheme: dict | None = kv_cache_scheme_of(raw)
        if self.kv_scheme is not None:
            check_scheme(self.kv_scheme, where)
            self._check_kv_values(matched, where)
        on = bool(self.act_specs) or self.kv_scheme is not None
        self.act_quant: bool = on if act_quant is None else bool(act_quant)
        self.act_quant_experts: bool = bool(act_quant_experts)
        static = frozenset(n for n, s in self.act_specs.items() if not s.dynamic)
        if self.act_quant:
            self._check_groups(where)
        self._check_input_scales(static, where)
        self._static = static

    # -- public ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def kv_quant(self) -> bool:
        """Whether what enters the KV cache is fake-quantized (a kv_cache_scheme and
        ``act_quant`` on)."""
        return self.act_quant and self.kv_scheme is not None

    def add_kv_hook(self, fn: KVHook) -> HookHandle:
        """Call ``fn(layer, kind, t)`` with every tensor as it enters the KV cache, before
        any fake quantization, in the cache and no-cache paths: GQA layers ``"k"`` (after
        k_norm and rope, [B, kv_heads, S, head_dim]) and ``"v"``; MLA layers ``"latent"``
        (kv_a_proj_with_mqa's latent after kv_a_layernorm, [B, S, kv_lora_rank]) and
        ``"k_rot"`` (the roped shared key, [B, 1, S, qk_rope_head_dim]). KDA layers keep
        no KV cache: no call. On a tensor-parallel runtime each rank's local heads come
        separately. The return value is ignored."""
        self._kv_hooks.append(fn)
        return HookHandle(self, fn, "_kv_hooks")

    def add_hook(self, fn: LinearHook, match: str | Iterable[str] | Callable | None = None):
        """Call ``fn(name, input, output)`` after every linear whose weight's source name
        matches (None: all; str: regex search; iterable: exact names; callable: predicate).
        A returned tensor replaces the output. Router linears get float32 inputs. The
        input is the one before activation fake-quantization (what a calibration observer
        needs); the output is computed from the quantized input when ``act_quant`` is on."""
        entry = (_matcher(match), fn)
        self._hooks.append(entry)
        return HookHandle(self, entry)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        on_layer: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V] float32.

        attention_mask [B, S] (1 = token, 0 = padding); with a ``cache`` holding P tokens
        it covers all P + S keys. position_ids default to P..P+S-1 for every row, as
        transformers' forward does. cache: a :class:`KVCache` that this call appends the
        S tokens to (prefill, then one token per decode step). on_layer(i, hidden): called
        with each decoder layer's output (verify's per-layer comparison).
        """
        input_ids = self._ids(input_ids)
        past = cache.length if cache is not None else 0
        if attention_mask is not None:
            attention_mask = self._mask(attention_mask, input_ids, past)
        if pixel_values is not None and self._widens:
            input_ids, attention_mask = self.expand_media(input_ids, image_grid_thw, attention_mask)
        if position_ids is None:
            position_ids = self.default_positions(input_ids, past)
        try:
            h = self.embed(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw)
            self._check_finite(h, "the embeddings", "embed")
            for i in range(self.num_layers):
                h = self.run_layer(i, h, position_ids, attention_mask, cache)
                self._check_finite(layer_output(h), f"layer {i}'s output", f"layer.{i}")
                if on_layer is not None:
                    on_layer(i, self._observed(i, h))
            logits = _finite(self.head(h), "the logits", "head")
            if cache is not None:
                cache.advance(input_ids.shape[1])
            return logits
        finally:
            self._release_units()
            self._step_key = self._step = None
            self._step_refs = ()

    __call__ = forward

    # the three places a parallel runtime differs in ``forward``
    def _check_finite(self, h: torch.Tensor, what: str, unit: str) -> None:
        _finite(h, what, unit)

    def _observed(self, i: int, h) -> torch.Tensor:
        """The hidden state ``on_layer`` receives after layer ``i`` (with attention
        residuals: the layer's output, the state's running sum)."""
        return layer_output(h)

    def _release_units(self) -> None:
        if not self.loader.resident:
            self.loader.release()

    @torch.inference_mode()
    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [B, S, H] in the compute dtype, image features spliced in
        (kimi_k3: each image's placeholder first expanded to its tokens, see
        :meth:`expand_media`; S is then the expanded length)."""
        input_ids = self._ids(input_ids)
        if pixel_values is not None and self._widens:
            input_ids, _ = self.expand_media(input_ids, image_grid_thw)
        special = None
        if self.vision is not None:
            special = input_ids == self.vision.image_token_id
            if self.vision.video_token_id is not None:
                special |= input_ids == int(self.vision.video_token_id)
        ids = input_ids.masked_fill(special, 0) if special is not None else input_ids
        h = self._embed_tokens(ids)
        if pixel_values is None:
            if image_grid_thw is not None:
                raise ConfigError("image_grid_thw was given without pixel_values.")
            if special is not None and bool(special.any()):
                raise ConfigError(
                    f"input ids hold {int(special.sum())} image token(s) (id "
                    f"{self.vision.image_token_id}) but no pixel_values were given."
                )
            return h
        if self.vision is None:
            raise ConfigError(
                f"pixel_values given, but this '{self.arch.name}' model has no vision tower; "
                f"only kimi_k25 and kimi_k3 (with a vision_config) take images."
            )
        if image_grid_thw is None:
            raise ConfigError("pixel_values need image_grid_thw [num_images, 3].")
        feats = self.encode_images(pixel_values, image_grid_thw)
        n_tok = int(special.sum())
        if n_tok != feats.shape[0]:
            raise ConfigError(
                f"input ids hold {n_tok} image token(s) (id {self.vision.image_token_id}) but "
                f"the images give {feats.shape[0]} merged patches; the prompt and the "
                f"images do not match."
            )
        h[special.to(h.device)] = feats.to(h.dtype)
        if self._widens:
            # as Moonshot's merge does: padding (and any token spelled as the pad id) and
            # the positions a shorter row is padded to are zero vectors
            h[(input_ids == self._pad_id).to(h.device)] = 0
        return h

    def expand_media(
        self,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        past: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kimi_k3 prompts hold ONE placeholder token per image (``<|media_pad|>``,
        ``media_placeholder_token_id``); the model widens it to the image's tokens
        (``h * w / (kh * kw)`` per grid_thw row) as Moonshot's
        ``_merge_input_ids_with_image_features`` does: rows get longer, shorter rows are
        padded to the longest with the pad token (mask 0) on the left, unless some row
        ends with a pad token (then on the right), and image positions are real tokens.
        Returns ``(ids [B, S'], mask [B, past + S'])`` (the mask None when given None and
        no row needs padding). Ids that already hold one placeholder per image token are
        returned as they are. Other families: unchanged."""
        ids = self._ids(input_ids)
        if not self._widens or image_grid_thw is None:
            return ids, attention_mask
        grid = torch.as_tensor(image_grid_thw)
        if grid.ndim != 2 or grid.shape[-1] != 3:
            raise ConfigError(f"image_grid_thw must be [num_images, 3], got {tuple(grid.shape)}.")
        kh, kw = self.vision.merge
        lengths = [(int(h) // kh) * (int(w) // kw) for _, h, w in grid.tolist()]
        tok = self.vision.image_token_id
        place = ids == tok
        n = int(place.sum())
        if n == sum(lengths):
            return ids, attention_mask
        if n != len(lengths):
            raise ConfigError(
                f"input ids hold {n} image placeholder(s) (id {tok}) for {len(lengths)} "
                f"image(s) giving {sum(lengths)} tokens; a kimi_k3 prompt holds one "
                f"placeholder per image (or one per image token)."
            )
        b, s = ids.shape
        occupy = torch.ones_like(ids)
        occupy[place] = torch.tensor(lengths, dtype=ids.dtype, device=ids.device)
        end = occupy.cumsum(-1) - 1  # each token's last position in the widened row
        width = int(end[:, -1].max()) + 1
        left = not bool((ids[:, -1] == self._pad_id).any())  # Moonshot's padding-side rule
        if left:
            end = end + (width - 1 - end[:, -1])[:, None]
        out = torch.full((b, width), self._pad_id, dtype=ids.dtype, device=ids.device)
        real = torch.zeros((b, width), dtype=torch.long, device=ids.device)
        rows = torch.arange(b, device=ids.device)[:, None].expand(b, s)
        text = ~place
        out[rows[text], end[text]] = ids[text]
        m = attention_mask[:, past:] if attention_mask is not None else torch.ones_like(ids)
        real[rows[text], end[text]] = m.to(real.device, torch.long)[text]
        for r, j in place.nonzero().tolist():
            stop = int(end[r, j]) + 1
            out[r, stop - int(occupy[r, j]) : stop] = tok
            real[r, stop - int(occupy[r, j]) : stop] = 1
        if attention_mask is None and bool(real.all()):
            return out, None
        if attention_mask is not None and past:
            real = torch.cat((attention_mask[:, :past].to(real.device, torch.long), real), 1)
        return out, real

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.loader.get("embed")
        table = w.need("embeddings.embed_tokens")
        check_vocab(ids, table.shape[0])
        return F.embedding(ids.to(table.device), table).to(self.dtype)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
        """Vision tower + projector: [num_image_tokens, H] in the compute dtype."""
        if self.vision is None:
            raise ConfigError(f"'{self.arch.name}' has no vision tower.")
        return self._encode(self.loader.get("vision"), pixel_values, image_grid_thw)

    def _encode(self, w: Weights, pixel_values, image_grid_thw) -> torch.Tensor:
        grid = torch.as_tensor(image_grid_thw).long().cpu()
        if self.arch.vision == "moonvit3d":
            return encode_images_k3(self.vision, self.linear, w, pixel_values, grid, self.dtype)
        feats, _ = encode_images(self.vision, self.linear, w, pixel_values, grid, self.dtype)
        return feats

    @torch.inference_mode()
    def run_layer(
        self,
        i: int,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Decoder layer ``i``: hidden [B, S, H] -> [B, S, H] (appending to ``cache``'s
        layer i; ``cache.length`` is not advanced here, ``forward`` does that).

        Models with attention residuals (Kimi K3) take and return an
        :class:`~.decoder.AttnResState` instead (layer 0 also takes the embeddings'
        tensor); its ``partial`` is the layer's output."""
        if not 0 <= i < self.num_layers:
            raise ConfigError(f"layer {i} does not exist; the model has {self.num_layers}.")
        hidden = self._layer_input(hidden, i)
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = self.default_positions(hidden, past)
        step = self._step_for(position_ids, attention_mask, hidden, past)
        w = self.loader.get(f"layer.{i}")
        lc = cache.layer(i) if cache is not None else None
        return decoder_layer(self.text, self.linear, w, hidden.to(self.dtype), i, step, lc)

    def _layer_input(self, hidden, i: int):
        """``hidden`` checked as the input of layer ``i`` (``num_layers``: the head)."""
        if self.text.attn_res_block is not None:
            return as_attn_res(self.text, hidden, i)
        if isinstance(hidden, AttnResState):
            raise ConfigError(
                f"'{self.arch.name}' has no attention residuals; pass the hidden state "
                f"tensor, not an AttnResState."
            )
        return hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: [B, S, H] -> logits [B, S, V] float32 (attention
        residuals: the last layer's :class:`~.decoder.AttnResState`, mixed first)."""
        hidden = self._layer_input(hidden, self.num_layers)
        w = self.loader.get("head")
        h = self._head_input(w, hidden.to(self.dtype))
        h = rms_norm(h, w.need("norms.final_norm"), self.text.rms_eps)
        return self.linear(w, "head.lm_head", h).float()

    def _head_input(self, w: Weights, hidden):
        if isinstance(hidden, AttnResState):
            return res_output(self.text, w, hidden)
        return hidden

    def default_positions(self, like: torch.Tensor, past: int = 0) -> torch.Tensor:
        b, s = like.shape[:2]
        return torch.arange(past, past + s, device=self.device)[None].expand(b, s)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ------------------------------------------------------------------
    def _activation_specs(self, raw: dict) -> dict[str, ActivationSpec]:
        """Weight name -> input-activation spec, for every Linear the forward runs that
        the quantization_config quantizes (static specs without their scale yet)."""
        specs: dict[str, ActivationSpec] = {}
        spec_for = activation_specs(raw)
        for unit in self.plan.units.values():
            for key, e in unit.items():
                if not _is_linear_key(key) or not e.name.endswith(".weight"):
                    continue
                spec = spec_for(e.name)
                if spec is not None:
                    specs[e.name] = spec
        return specs

    def _check_kv_values(self, matched: dict, where: str) -> None:
        """A checkpoint's KV-cache scales are read at open (two [1] tensors a layer):
        each must be one finite positive number. Other sources are checked on use."""
        if not isinstance(self.source, Checkpoint):
            return
        for name, m in matched.items():
            if m.role.kind not in ("k_scale", "v_scale"):
                continue
            t = self.source.get(name, torch.float32).reshape(-1)
            if t.numel() != 1 or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise CheckpointError(
                    f"{where}: KV-cache scale '{name}' is {t.tolist()}; each scale must be "
                    f"one finite positive number (a non-finite or zero scale breaks the FP8 "
                    f"cache of every serving engine). Re-run quantize --kv-cache fp8."
                )

    def _check_groups(self, where: str) -> None:
        """Group-wise activation specs need in_features divisible by the group size:
        compressed-tensors cannot quantize such an input (and serving kernels reject it)."""
        meta = getattr(self.source, "meta", None)
        if meta is None:
            return
        bad = [
            (name, meta(name).shape[-1], spec.group_size)
            for name, spec in self.act_specs.items()
            if spec.strategy == "group"
            and meta(name).shape[-1] % spec.group_size
            and (self.act_quant_experts or name not in self.routed_weights)
        ]
        if bad:
            raise _group_error(where, bad)

    def _check_input_scales(self, static: frozenset[str], where: str) -> None:
        """Static activation specs need each Linear's input_scale: fail at open if absent."""
        if not static:
            return
        meta = getattr(self.source, "meta", None)
        # a parallel runtime's global view lists the parts; its rank readers hand them out
        parts_ok = hasattr(self.source, "get_parts") or getattr(self.source, "rank_parts", False)
        if meta is None or not parts_ok:
            if self.act_quant:
                raise CheckpointError(
                    f"{where}: the quantization_config uses static activation scales, but "
                    f"this weight source cannot hand out the 'input_scale' parts (it has no "
                    f"meta()/get_parts()); open the checkpoint with open_checkpoint, or pass "
                    f"act_quant=False."
                )
            return
        missing = sorted(n for n in static if "input_scale" not in meta(n).parts)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(
                f"{where}: the quantization_config gives {len(missing)} Linear(s) static "
                f"input activation scales, but the checkpoint stores no input_scale for "
                f"{', '.join(missing[:3])}{more}; the checkpoint is incomplete (re-run "
                f"quantize with calibration)."
            )

    def _quant_input(self, w: Weights, key: str, name: str, x: torch.Tensor) -> torch.Tensor:
        spec = self.act_specs.get(name)
        if spec is None:
            return x
        expert = name in self.routed_weights
        if expert and not self.act_quant_experts:
            return x
        if not spec.dynamic:
            scale = w.get(key + "_input_scale")
            if scale is None:
                raise CheckpointError(
                    f"'{name}': static activation quantization needs its input_scale, which "
                    f"the weight source did not provide; pass act_quant=False to run "
                    f"without activation quantization."
                )
            spec = spec.with_scale(scale, w.get(key + "_input_zero_point"))
        if spec.strategy == "group" and x.shape[-1] % spec.group_size:
            raise _group_error(str(getattr(self.source, "root", "source")),
                               [(name, x.shape[-1], spec.group_size)])  # fmt: skip
        if expert and spec.dynamic and spec.strategy == "token":
            # [tokens, in] rows: one scale per token, as serving MoE kernels quantize
            return fake_quant_activation(x[:, None], spec)[:, 0]
        return fake_quant_activation(x, spec)

    def linear(self, w: Weights, key: str, x: torch.Tensor) -> torch.Tensor:
        name = w.names[key]
        xq = self._quant_input(w, key, name, x) if self.act_quant else x
        y = F.linear(xq, w.need(key), w.get(key + "_bias"))
        if self._hooks:
            for match, fn in list(self._hooks):
                if match(name):
                    r = fn(name, x, y)
                    if r is not None:
                        y = r
        return y

    def _step_for(self, position_ids, attention_mask, hidden, past: int = 0) -> Step:
        """Rope tables and masks, built once per (position_ids, attention_mask) pair.

        Cached on the identity of the caller's tensors (kept alive while cached, so an id
        cannot be reused); mutating them in place between layers is not supported.
        """
        fused = not (self.act_quant and self.act_specs)  # see decoder.Step.fused_mla
        key = (id(position_ids), id(attention_mask), tuple(hidden.shape[:2]), past, fused)
        if self._step is not None and self._step_key == key:
            return self._kv_step(self._step)
        refs = (position_ids, attention_mask)
        mask = self._mask(attention_mask, hidden, past) if attention_mask is not None else None
        pos = torch.as_tensor(position_ids)
        if pos.ndim == 1:
            pos = pos[None]
        if pos.shape[-1] != hidden.shape[1]:
            raise ConfigError(
                f"position_ids cover {pos.shape[-1]} positions but the hidden states have "
                f"{hidden.shape[1]}."
            )
        pos = pos.expand(hidden.shape[0], -1)
        self._step = make_step(self.text, pos, mask, self.device, past, fused)
        self._step_key, self._step_refs = key, refs
        return self._kv_step(self._step)

    def _kv_step(self, step: Step) -> Step:
        """The KV-cache settings of now (hooks and act_quant may change between calls)."""
        step.kv_hooks = self._kv_hooks
        step.kv_quant = self.kv_quant
        return step

    def _ids(self, input_ids) -> torch.Tensor:
        t = torch.as_tensor(input_ids)
        if t.ndim == 1:
            t = t[None]
        if t.ndim != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ConfigError(
                f"input_ids must be an integer tensor [batch, seq], got {t.dtype} {tuple(t.shape)}."
            )
        if t.numel() == 0:
            raise ConfigError(
                f"input_ids is empty ({tuple(t.shape)}); give at least one token per sequence."
            )
        return t.long().to(self.device)

    def _mask(self, mask, like: torch.Tensor, past: int = 0) -> torch.Tensor:
        m = torch.as_tensor(mask)
        if m.ndim == 1:
            m = m[None]
        want = (like.shape[0], past + like.shape[1])
        if tuple(m.shape) != want:
            cached = f" (the {past} cached tokens included)" if past else ""
            raise ConfigError(
                f"attention_mask shape {tuple(m.shape)} does not match the input's "
                f"[batch, keys] {want}{cached}."
            )
        return m.to(self.device)


def check_vocab(ids: torch.Tensor, vocab: int) -> None:
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ConfigError(
            f"input ids must lie in [0, {vocab}) (the vocabulary size); got "
            f"{int(ids.min())}..{int(ids.max())}."
        )


def _finite(t: torch.Tensor, what: str, unit: str) -> torch.Tensor:
    """``t`` if it holds no NaN / inf; else the error that names the first bad stage.

    One float32 sum first (a NaN or inf anywhere makes it non-finite): ~20x cheaper than
    ``isfinite(t).all()`` on the logits; only a non-finite sum (possibly an overflow of
    finite values) pays for the exact test."""
    if not bool(torch.isfinite(t.sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
        raise NonFiniteError(
            f"{what} hold NaN or infinite values: the weights of unit '{unit}' (or their "
            f"scales), or a config value they use, are not finite. Check the source with "
            f"`k3convert inspect`, and the config's eps / scaling values."
        )
    return t


def _group_error(where: str, bad: list[tuple[str, int, int]]) -> ConfigError:
    shown = ", ".join(f"{n} ({width} inputs, groups of {g})" for n, width, g in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    return ConfigError(
        f"{where}: the quantization_config quantizes Linear inputs group-wise, but "
        f"{len(bad)} Linear(s) have an input width that is not a multiple of the group "
        f"size: {shown}{more}. compressed-tensors (and serving engines) cannot run this "
        f"checkpoint with activation quantization either; re-quantize those Linears with "
        f"another scheme (or keep them), or run without activation quantization "
        f"(act_quant=False, k3convert forward --no-act-quant)."
    )


#: components whose (non-bias) tensors are Linear weights run through ``linear``
LINEAR_COMPONENTS = ("attention", "linear_attention", "dense_mlp", "shared_experts", "latent",
                     "routed_experts", "head")  # fmt: skip
#: keys of those components that are not Linear weights (KDA convolutions and gate
#: parameters, the latent MoE's norm)
NOT_LINEAR = ("linear_attention.q_conv1d", "linear_attention.k_conv1d",
              "linear_attention.v_conv1d", "linear_attention.A_log", "linear_attention.dt_bias",
              "latent.routed_expert_norm", "attention.k_scale", "attention.v_scale")  # fmt: skip
#: vision / projector kinds that are Linear weights
VISION_LINEARS = ("vision.wqkv", "vision.wo", "vision.fc0", "vision.fc1", "projector.proj_in",
                  "projector.proj_out")  # fmt: skip


def _is_linear_key(key: str) -> bool:
    """Unit keys (``attention.q_proj``, ``routed_experts.3.up_proj``,
    ``blocks.0.vision.wqkv``) of Linear weights; routers and norms are not."""
    if key.endswith("_bias") or key in NOT_LINEAR:
        return False
    if key.startswith("blocks."):
        key = key.split(".", 2)[2]
    return key.split(".", 1)[0] in LINEAR_COMPONENTS or key in VISION_LINEARS


def _text_cfg(cfg):
    return getattr(cfg, "text", cfg) if hasattr(cfg, "vision") else cfg
