"""``k3convert plan``: device memory per rank for a parallel layout and a serving workload.

Needs no weights: a config.json (or a bundled preset) is enough; a model directory's own
stored tensors are used when it has them. Four components per rank, all in bytes:

**Weights** - exactly what ``shard`` would write to that rank: the tensor bytes of its
units (no file header or 4096-byte alignment padding; a vocab-parallel piece includes its
zero rows). The tensors come from the checkpoint, or for a config alone from what
``synth`` would write for it (the config dtype; its ``quantization_config``'s encodings:
Kimi K3's routed experts MXFP4 as released, DeepSeek-V3 / Kimi-K2 FP8 blocks). With
``--scheme`` or a recipe's ``quantize`` section the tensors are first resolved as
``quantize`` would write them (:func:`k3convert.quant.rules.resolve`, each row's stored
parts), then cut by the shard planner's own split rules (``shard.plan.Splitter``),
pipeline partition (``partition_layers``) and expert placement (``place_experts``, with
``--redundant-experts``; without ``--expert-load`` the copies go to the lowest-numbered
experts, which changes nothing when every expert has the same size). The sums are
grouped by tensor signature so that a layout costs milliseconds; the tests check them
against ``build_plan`` and against a written shard manifest, byte for byte.

**KV cache** (exact; ``tokens`` = ``--context``, ``B`` = ``--batch``, ``b`` = bytes of
``--kv-dtype``) per rank, over the decoder layers of its pipeline stage (MTP layers'
caches are not counted):

- GQA layer: ``2 * kv_local * head_dim * tokens * B * b``; ``kv_local = kv_heads / tp``,
  or 1 when ``tp > kv_heads`` (each rank holds one replicated KV head group).
- MLA layer: ``(kv_lora_rank + qk_rope_head_dim) * tokens * B * b``: the compressed
  latent cache serving engines keep (DeepSeek's absorbed scheme); it is replicated on
  every TP rank of the stage, so it does not shrink with tp.
- KDA layer (Kimi-Linear / Kimi K3): no per-token cache; a fixed state per sequence that
  does not grow with the context: ``B * (H_local * D * D * 4 + 3 * H_local * D * (K - 1)
  * a)`` with ``H_local = kda_heads / tp``, D the KDA head dim, K the short-conv kernel:
  the float32 recurrent state and the last ``K - 1`` inputs of the q / k / v short
  convolutions. Those are in the projection outputs' dtype (``runtime/kda.py``:
  ``KDAState``), the activation dtype ``a`` = bf16 (2 bytes); ``--kv-dtype`` changes
  neither (the runtime keeps KDA states in float32 whatever the cache dtype is).

**Activations** - an ESTIMATE, not a measurement: the peak of one decoder layer's
working set while prefilling a chunk of ``T = min(--prefill-chunk, B * tokens)`` tokens,
in bf16 (``a = 2``) unless noted, per rank (widths divided by tp as the rank holds them):

- residual stream: ``3 * T * hidden * a`` (hidden state, normed input, the block's
  partial output before its all-reduce);
- attention block: GQA ``T * a * (2 * H_local * d + 2 * kv_local * d)`` (q, output, k, v;
  flash attention keeps no score matrix); MLA ``T * a * (q_lora + kv_lora + rope +
  H_local * (2 * qk_head + 2 * v_head))`` (compressed q / kv, q, the chunk's expanded k
  and v, the output); KDA ``T * H_local * D * (4 * a + 5 * 4)`` (q / k / v / output-gate
  projections, and q, k, v, decay and output in float32 as the kernel computes them);
- MLP block: dense ``3 * T * I_local * a`` (gate, up, their product); MoE: the token
  copies an EP rank's experts receive under balanced routing, ``S = ceil(T * top_k /
  ep)``, each with its dispatched input and output (``2 * h_e``) and the expert's gate /
  up / product (``3 * I_e / moe_tp``): ``S * a * (2 * h_e + 3 * I_e / moe_tp)``, plus
  the router's float32 logits ``T * E * 4``, the shared experts ``3 * T * a * n_shared *
  I_e / tp`` and, for a latent MoE, ``2 * T * h_e * a`` (h_e: the routed experts' width);
- a layer's peak: residual + max(attention block, MLP block); a stage's: the largest of
  its layers, plus on the last stage the float32 logits of the chunk's last token per
  sequence after the vocab-parallel head's all-gather, ``B * vocab * 4``.

It leaves out the serving engine's own reservations (CUDA graphs, allocator slack,
communication buffers), hot-expert imbalance, the vision tower's activations and
sliding-window caps (every layer caches the full context).

**Budget**: ``--device-mem`` (``141GB``, ``140GiB``, ``1.5TB``: GB = 10^9, GiB = 2^30
bytes) or ``--device NAME``, a published capacity (:data:`DEVICES`, decimal GB as the
vendors state them). Ranks over budget are flagged; the smallest layouts that fit are
searched (tp among the degrees the model's heads allow, ep dividing tp and the expert
slots, pp up to the layer count), ranked by device count then peak rank memory.
Exit codes (CLI): 0 whether or not it fits (the FLAG column says OVER), 1 with
``--fail-if-over`` when a rank is over budget, 2 for bad input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .arch import load_config, resolve, validate_source
from .arch.base import Arch, Role
from .checkpoint import Checkpoint, PartMeta, TensorMeta
from .checkpoint.reader import QuantConfig
from .errors import ConfigError, K3Error, short_list
from .formats import detect_encoding
from .layout import Layout, divisors, partition_layers, place_experts
from .shard.plan import Splitter, load_expert_load, unit_sort_key, units_by_stage
from .units import human_bytes, parse_size, parse_tokens

FORMAT = "k3convert-plan-v1"

#: published memory per device, in bytes (vendors state decimal GB: 1 GB = 10^9 bytes;
#: what the driver reports is usually a little less, and serving engines reserve some)
DEVICES: dict[str, int] = {
    # NVIDIA A100 80GB: 80 GB HBM2e (https://www.nvidia.com/en-us/data-center/a100/)
    "a100": 80 * 10**9,
    # NVIDIA H100 SXM: 80 GB HBM3 (https://www.tweaktown.com/news/86032/nvidia-h100-sxm-in-
    # the-flesh-4nm-hopper-gpu-80gb-hbm3-memory/index.html; H100 vs H200 table at
    # https://lzwjava.github.io/nvidia-h200-gpu-specs-en)
    "h100": 80 * 10**9,
    # NVIDIA H200: 141 GB HBM3e (https://www.saulelectric.com/nvidia-h200.html,
    # https://www.aiminingco.com/gpu/h200/specs)
    "h200": 141 * 10**9,
    # NVIDIA B200 as shipped in DGX / HGX B200: 8 GPUs "provide 1,440 GB total GPU memory",
    # 180 GB each (https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html);
    # the package is often quoted at 192 GB (https://glennklockwood.com/garden/processors/B200)
    "b200": 180 * 10**9,
    # AMD Instinct MI300X: 192 GB HBM3 (https://aiwiki.ai/wiki/amd_instinct_mi300x,
    # https://www.jaredwatkins.com/research/ai-accelerators/amd-instinct/mi300-series/)
    "mi300x": 192 * 10**9,
    # AMD Instinct MI325X: 256 GB HBM3E as shipped (announced with up to 288 GB)
    # (https://aiwiki.ai/wiki/amd_instinct_mi325x, https://yobitel.com/knowledge-base/amd-mi325x)
    "mi325x": 256 * 10**9,
    # Moore Threads MTT S5000: 80 GB, 1.6 TB/s, disclosed in February 2026
    # (https://rutab.net/b/hardware/2026/02/12/novyy-kitayskiy-gpu-mtt-s5000-vpervye-
    # predstavlen-80-gb-pamyati-i-1-petaflops-dlya-konkurencii-s-nvidia-h100.html,
    # https://www.ldeepai.com/tech-hub/moore-threads-mtt-s5000-1000-tflops-fp8-gpu/)
    "mtt-s5000": 80 * 10**9,
}

#: --kv-dtype -> bytes per cached value
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
#: activation (and KDA conv state) bytes: bf16
ACT_BYTES = 2
F32 = 4
COMPONENTS = ("weights", "kv_cache", "kda_state", "activations")


def device_budget(device_mem: str | int | None, device: str | None) -> tuple[int | None, str]:
    """(bytes, label) of the memory per device; (None, '') when neither is given."""
    if device_mem is not None and device is not None:
        raise ConfigError("give --device-mem SIZE or --device NAME, not both.")
    if device is not None:
        key = device.strip().lower()
        if key not in DEVICES:
            raise ConfigError(
                f"--device '{device}' is not known; known devices: {', '.join(DEVICES)} "
                f"(or give --device-mem SIZE, e.g. 141GB)."
            )
        return DEVICES[key], f"{key} ({DEVICES[key] / 1e9:g} GB)"
    if device_mem is not None:
        n = parse_size(device_mem)
        return n, f"{device_mem}".strip()
    return None, ""


# -- the tensors a source stores -------------------------------------------------------
def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _quant_config_of(raw: dict) -> dict | None:
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    return qc if isinstance(qc, dict) else None


def _qkey(q) -> tuple:
    extra = q.extra or {}
    return (q.num_bits, q.block, q.symmetric, extra.get("strategy"), extra.get("type"))


class _MetaMaker:
    """TensorMetas (no data, ``PartMeta.raw`` None) for parts given as (suffix, dtype,
    shape), grouped and completed as the reader groups a stored tensor; identical
    tensors share one object (only the sums are needed, not the names)."""

    def __init__(self, where: Path):
        self.where = where
        self._cache: dict[tuple, TensorMeta] = {}
        self._enc: dict[tuple, Any] = {}

    def make(self, name, parts, shape, qparams) -> TensorMeta:
        """parts: [(suffix, dtype, shape)]; shape: the logical shape; qparams(): the
        config's QuantParams for it, asked only when the parts are an encoding."""
        pkey = (tuple(parts), tuple(shape))
        enc = self._enc.get(pkey, False)
        if enc is False:
            sig = {k: (tuple(s), d) for k, d, s in parts}
            enc = detect_encoding(name, sig) if set(sig) != {"weight"} else None
            self._enc[pkey] = enc
        q = qparams() if enc is not None else None
        key = (pkey, q and _qkey(q))
        m = self._cache.get(key)
        if m is None:
            pm = {
                k: PartMeta(
                    name if k == "weight" else f"{name}.{k}", self.where, d, tuple(s), _nbytes(d, s)
                )
                for k, d, s in parts
            }
            if enc is None:
                m = TensorMeta(name, tuple(pm["weight"].shape), "plain", pm)
            else:
                sig = {k: (tuple(s), d) for k, d, s in parts}
                q = enc.resolve_quant(name, sig, tuple(shape), q)
                m = TensorMeta(name, tuple(shape), enc.name, pm, q)
            self._cache[key] = m
        return m


def _module_free(qc: QuantConfig) -> bool:
    """Whether the config's weight args depend on nothing but the tensor (every group
    targets the class ``Linear``): then one lookup serves every tensor of a shape."""
    return qc.method != "compressed-tensors" or all(
        t == "Linear" for targets, _ in qc.groups for t in targets
    )


@dataclass
class Tensors:
    """Every logical tensor a checkpoint stores: name, role and metadata (no data)."""

    arch: Arch
    cfg: Any
    config: dict
    names: list[str]
    roles: list[Role]
    metas: list[TensorMeta]
    origin: str  # "config" (what synth would write) or "checkpoint"
    root: Path
    quantized: str | None = None  # the scheme / recipe applied, for the report
    qplan: Any = None  # the quantize Plan applied (k3convert.serving checks it)

    def checkpoint(self) -> Checkpoint:
        """A metadata-only Checkpoint of these tensors (``shard.plan.build_plan`` runs on it)."""
        return Checkpoint(
            self.root, self.config, dict(zip(self.names, self.metas, strict=True)), []
        )


def _synth_dtype(raw: dict) -> tuple[torch.dtype, str]:
    from .formats.dtypes import SHORT_DTYPES, SHORT_NAMES
    from .synth import text_section

    src = str(text_section(raw).get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "")
    name = SHORT_NAMES.get(src, "bf16")
    return SHORT_DTYPES[name], name


def _instances(arch: Arch, cfg: Any):
    """``arch.instances(cfg)`` (MTP layers included), with each row's shape computed once
    instead of once per layer and expert (a quarter of a million tensors for Kimi K3)."""
    from .arch.base import Instance, role_of, scope_indices, stored_shape_of

    for spec in arch.table(cfg):
        if spec.optional:
            continue
        shape, stored = tuple(spec.shape(cfg)), stored_shape_of(spec, cfg)
        for idx in scope_indices(spec.scope, cfg, True):
            yield Instance(spec.pattern.format(**idx), shape, role_of(spec, idx, cfg), stored)


def config_tensors(raw: dict, where: str) -> Tensors:
    """What ``synth`` would write for this config, at its full size: every tensor the
    architecture table implies (MTP layers included), in the config dtype, encoded as the
    config's quantization_config says (``synth.encoding_for(..., "auto")``)."""
    from .synth import encoding_for, output_config, plan_instance

    arch, cfg = resolve(raw, where)
    dtype, dtype_name = _synth_dtype(raw)
    insts = list(_instances(arch, cfg))
    encs = [encoding_for(i, raw, "auto") for i in insts]
    used = set(encs) - {"plain"}
    out_cfg = output_config(raw, used.pop() if len(used) == 1 else "plain", dtype_name)
    qc = QuantConfig(_quant_config_of(out_cfg))
    free, qcache = _module_free(qc), {}
    maker = _MetaMaker(Path(where))
    planned: dict[tuple, list] = {}
    names, roles, metas = [], [], []
    for inst, enc in zip(insts, encs, strict=True):
        key = (enc, inst.stored_shape)
        parts = planned.get(key)
        if parts is None:
            p = plan_instance(inst, enc, dtype, raw)
            parts = [
                ("weight" if n == inst.name else n.rsplit(".", 1)[1], d, tuple(s))
                for n, d, s in p.parts
            ]
            planned[key] = parts
        module = inst.name.removesuffix(".weight")
        qkey = (None if free else module, inst.stored_shape)

        def qparams(qkey=qkey, module=module, shape=inst.stored_shape):
            q = qcache.get(qkey)
            if q is None:
                q = qcache[qkey] = qc.params(module, shape)
            return q

        names.append(inst.name)
        roles.append(inst.role)
        metas.append(maker.make(inst.name, parts, inst.stored_shape, qparams))
    return Tensors(arch, cfg, out_cfg, names, roles, metas, "config", Path(where))


def checkpoint_tensors(path: Path) -> Tensors:
    """A model directory's own stored tensors, validated as ``shard`` validates them."""
    from .checkpoint import open_checkpoint

    ck = open_checkpoint(path)
    where = str(Path(ck.root) / "config.json")
    arch, cfg = resolve(ck.config, where)
    matched = validate_source(arch, cfg, ck, str(ck.root))
    names = ck.names()
    return Tensors(
        arch,
        cfg,
        ck.config,
        names,
        [matched[n].role for n in names],
        [ck.meta(n) for n in names],
        "checkpoint",
        Path(ck.root),
    )


def quantized_tensors(t: Tensors, *, scheme: str | None = None, recipe=None) -> Tensors:
    """The tensors ``quantize --scheme`` / ``--recipe`` would write from ``t``: the same
    rule resolution as :func:`k3convert.quant.planning.plan_quantization` (keeps, recipe
    rules, default scheme, kept encoded tensors as stored when a scheme describes them),
    then each row's stored parts (:func:`k3convert.quant.planning.row_entries`)."""
    from .quant import planning
    from .quant.rules import resolve as resolve_rules
    from .quant.schemes import get_scheme

    rules, default, keep, default_keep = [], None, [], True
    if scheme is not None:
        default, label = get_scheme(scheme), f"--scheme {scheme}"
    else:
        rules, default_name, keep, rdk = planning.recipe_rules(recipe)
        default = get_scheme(default_name) if default_name else None
        default_keep = rdk is not False
        label = f"recipe {recipe.origin}"
    ck = t.checkpoint()
    roles = dict(zip(t.names, t.roles, strict=True))
    plan = resolve_rules(
        planning.tensor_infos(ck, roles),
        arch=t.arch.name,
        rules=rules,
        default=default,
        keep=keep,
        default_keep=default_keep,
        unstored=planning.tied_linears(t.arch, t.cfg),
    )
    maker = _MetaMaker(t.root)
    qcs: dict[int, QuantConfig] = {}
    qcache: dict[tuple, Any] = {}
    metas = []
    for r in plan.rows:
        r = planning.keep_as_stored(ck, r)
        base = r.module
        parts = [
            ("weight" if n == r.name else n[len(base) + 1 :], d, tuple(s))
            for n, d, s in planning.row_entries(r)
        ]
        if r.kept:
            metas.append(maker.make(r.name, parts, r.shape, None))
            continue
        s = r.scheme
        if id(s) not in qcs:  # the config group quantize writes for this scheme
            group = {"g": s.ct_scheme(["Linear"])}
            qcs[id(s)] = QuantConfig({"quant_method": "compressed-tensors", "config_groups": group})

        def qparams(s=s, module=base, shape=r.shape):
            q = qcache.get((id(s), shape))
            if q is None:
                q = qcache[(id(s), shape)] = qcs[id(s)].params(module, shape)
            return q

        metas.append(maker.make(r.name, parts, r.shape, qparams))
    return Tensors(
        t.arch, t.cfg, t.config, list(t.names), list(t.roles), metas, t.origin, t.root, label,
        plan,
    )  # fmt: skip


# -- weights per rank ------------------------------------------------------------------
def _piece_bytes(piece) -> int:
    return sum(_nbytes(ps.src.dtype, ps.shape) for ps in piece.parts)


class WeightModel:
    """Per-rank weight bytes of any layout, computed as ``shard.plan.build_plan`` cuts
    the tensors (the same splitter, partition and placement), summed by signature."""

    def __init__(self, t: Tensors):
        self.t = t
        self.cfg = t.cfg
        roles, metas = t.roles, t.metas
        items = [(r.unit, r, m) for r, m in zip(roles, metas, strict=True)]
        has_head = any(r.kind == "lm_head" for r in roles)
        embed = [i for i, r in enumerate(roles) if r.kind == "embed_tokens" and not r.mtp]
        tied = getattr(self.cfg, "tie_word_embeddings", False) and not has_head and embed
        if tied and any(s.kind == "lm_head" for s in t.arch.specs(self.cfg)):
            i = embed[0]  # build_plan: a tied lm_head is a copy of the embedding, in "head"
            items.append(("head", roles[i], metas[i]))
        self.classes: list[tuple[TensorMeta, Role]] = []
        index: dict[tuple, int] = {}
        self.unit_bytes: dict[str, int] = {}
        self.dense: dict[str, dict[int, int]] = {}  # unit -> class -> count
        experts: dict[str, dict[int, list[int]]] = {}  # unit -> expert -> classes
        self.expert_layer: dict[str, int] = {}
        self.expert_role: dict[int, Role] = {}
        for unit, role, m in items:
            self.unit_bytes[unit] = self.unit_bytes.get(unit, 0) + m.nbytes
            key = (id(m), role.split, role.kind, role.expert is not None)
            c = index.get(key)
            if c is None:
                c = index[key] = len(self.classes)
                self.classes.append((m, role))
            if role.expert is None:
                d = self.dense.setdefault(unit, {})
                d[c] = d.get(c, 0) + 1
            else:
                experts.setdefault(unit, {}).setdefault(role.expert, []).append(c)
                self.expert_layer[unit] = role.layer
                self.expert_role.setdefault(role.layer, role)
        # the experts of a unit: one kind (its sorted tuple of classes) per expert
        self.expert_kinds: dict[str, tuple[list[tuple[int, ...]], dict[int, int]]] = {}
        for unit, by_e in experts.items():
            kinds: list[tuple[int, ...]] = []
            kidx: dict[tuple[int, ...], int] = {}
            of: dict[int, int] = {}
            for e, cs in by_e.items():
                k = tuple(sorted(cs))
                if k not in kidx:
                    kidx[k] = len(kinds)
                    kinds.append(k)
                of[e] = kidx[k]
            self.expert_kinds[unit] = (kinds, of)
        self.units = sorted(self.unit_bytes, key=unit_sort_key)
        self._vec: dict[tuple, list[int]] = {}
        self._unit_vec: dict[tuple, list[int]] = {}
        self._ranges: dict[tuple, list[tuple[int, int]]] = {}
        self._placed: dict[tuple, dict | None] = {}

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def _class_vec(self, c: int, tp: int, moe_tp: int) -> list[int]:
        """Bytes of class ``c`` on each local rank: tp entries (dense) or moe_tp (experts)."""
        m, role = self.classes[c]
        expert = role.expert is not None
        key = (c, tp, moe_tp if expert else tp)
        v = self._vec.get(key)
        if v is None:
            sp = Splitter(self.cfg, Layout(tp=tp, moe_ep=tp // moe_tp))
            view = sp.view(m, role)
            pieces = sp.pieces(view, role)
            if pieces is None:
                v = [view.nbytes] * (moe_tp if expert else tp)
            else:
                v = [_piece_bytes(p) for p in pieces]
            self._vec[key] = v
        return v

    def ranges(self, pp: int, pp_layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """Layer range per stage, as build_plan partitions them (by stored bytes)."""
        key = (pp, tuple(pp_layers) if pp_layers is not None else None)
        r = self._ranges.get(key)
        if r is None:
            ub = self.unit_bytes
            layer_bytes = [ub.get(f"layer.{i}", 0) for i in range(self.num_layers)]
            first = ub.get("embed", 0) + ub.get("vision", 0)
            last = sum(b for u, b in ub.items() if u == "head" or u.startswith("mtp."))
            r = partition_layers(
                layer_bytes, pp, first_fixed=first, last_fixed=last, explicit=pp_layers
            )
            self._ranges[key] = r
        return r

    def placement(self, layout: Layout, load, redundant: int) -> dict[int, list] | None:
        """MoE layer -> experts held by each EP rank, as build_plan places them
        (``shard.plan._place``'s rules, each distinct count list placed once); redundant
        copies without routing counts are placed from uniform counts (the
        lowest-numbered experts get the copies)."""
        key = (layout.moe_ep, redundant, id(load))
        if key in self._placed:
            return self._placed[key]
        layers = sorted(self.expert_role)
        if not layers:
            if redundant:
                raise ConfigError(
                    "--redundant-experts was given but the model has no routed experts."
                )
            self._placed[key] = None
            return None
        n = self.cfg.num_experts
        if redundant and load is None:
            load = {L: [1.0] * n for L in layers}
        if load is not None:
            missing = [L for L in layers if L not in load and self.num_layers > L]
            if missing:
                raise ConfigError(
                    f"--expert-load has no routing counts for MoE layer(s) {missing}; give "
                    f"counts for every MoE layer, or leave it out for contiguous placement."
                )
        done: dict[tuple, list] = {}
        out = {}
        for L in layers:
            counts = None if load is None else load.get(L, [1.0] * n)
            ck = tuple(counts) if counts is not None else None
            if ck not in done:
                done[ck] = place_experts(
                    n, layout.moe_ep, load=counts, redundant=redundant, where=f"layer {L}"
                )
            out[L] = done[ck]
        self._placed[key] = out
        return out

    def unit_vector(self, u: str, layout: Layout, placed: dict | None) -> list[int]:
        """Bytes of unit ``u`` on each tp rank of its stage."""
        tp, moe_tp = layout.tp, layout.moe_tp
        key = (u, tp, moe_tp, id(placed))
        v = self._unit_vec.get(key)
        if v is not None:
            return v
        v = [0] * tp
        for c, n in self.dense.get(u, {}).items():
            for i, b in enumerate(self._class_vec(c, tp, tp)):
                v[i] += n * b
        if u in self.expert_kinds:
            kinds, of = self.expert_kinds[u]
            kvec = [
                [sum(x) for x in zip(*(self._class_vec(c, tp, moe_tp) for c in k), strict=True)]
                for k in kinds
            ]
            held = placed[self.expert_layer[u]]
            for e, experts in enumerate(held):
                if len(kinds) == 1:
                    for j, b in enumerate(kvec[0]):
                        v[e * moe_tp + j] += len(experts) * b
                    continue
                for x in experts:
                    for j, b in enumerate(kvec[of[x]]):
                        v[e * moe_tp + j] += b
        self._unit_vec[key] = v
        return v

    def per_rank(
        self,
        layout: Layout,
        *,
        pp_layers: Sequence[int] | None = None,
        load=None,
        redundant: int = 0,
    ) -> tuple[list[int], list[tuple[int, int]], list[list[str]]]:
        """(weight bytes per global rank, layer range per stage, units per stage)."""
        ranges = self.ranges(layout.pp, pp_layers)
        stages = units_by_stage(self.units, ranges)
        for s, us in enumerate(stages):
            if not us:
                raise ConfigError(
                    f"pipeline stage {s} of pp={layout.pp} would hold nothing (layers per "
                    f"stage {short_list([b - a for a, b in ranges])}); use pp <= "
                    f"{self.num_layers} or set --pp-layers."
                )
        placed = self.placement(layout, load, redundant)
        out = [0] * layout.world
        for s, us in enumerate(stages):
            for u in us:
                for t, b in enumerate(self.unit_vector(u, layout, placed)):
                    out[layout.rank(s, t)] += b
        return out, ranges, stages


def build_plan_bytes(t: Tensors, layout: Layout, **kw) -> list[int]:
    """Per-rank tensor bytes of ``shard.plan.build_plan`` run on a metadata-only
    checkpoint of ``t`` (what ``shard`` writes): the reference :class:`WeightModel` must
    equal. Slow for a full-size model (every tensor entry of every rank is built)."""
    from .shard.plan import build_plan

    plan = build_plan(t.checkpoint(), layout, **kw)
    out = [0] * layout.world
    for u in plan.units:
        for tp in u.tensors:
            e = tp.entry
            out[u.rank] += _nbytes(tp.slice.src.dtype, e["shape"])
    return out


# -- KV cache, KDA state, activations ---------------------------------------------------
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


# -- the plan -----------------------------------------------------------------------------
@dataclass
class RankMemory:
    rank: int
    pp_rank: int
    tp_rank: int
    ep_rank: int
    weights: int
    kv_cache: int
    kda_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.kda_state + self.activations


@dataclass
class LayoutFit:
    tp: int
    pp: int
    ep: int
    peak: int
    budget: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def to_json(self) -> dict:
        return {
            "devices": self.devices,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "moe_tp": self.tp // self.ep,
            "peak_bytes": self.peak,
            "free_bytes": self.budget - self.peak,
        }


@dataclass
class MemoryPlan:
    source: str
    model: dict
    layout: Layout
    redundant_experts: int
    workload: Workload
    stages: list[tuple[int, int]]
    ranks: list[RankMemory]
    budget: int | None = None
    device: str = ""
    search: list[LayoutFit] | None = None
    search_note: str = ""
    notes: list[str] = field(default_factory=list)
    #: what vLLM would refuse at this layout (:mod:`k3convert.serving`), one line each
    warnings: list[str] = field(default_factory=list)

    @property
    def over(self) -> list[int]:
        if self.budget is None:
            return []
        return [r.rank for r in self.ranks if r.total > self.budget]

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else not self.over

    @property
    def peak(self) -> int:
        return max(r.total for r in self.ranks)

    def to_json(self) -> dict:
        w = self.workload
        return {
            "format": FORMAT,
            "source": self.source,
            "model": self.model,
            "layout": {
                **self.layout.to_json(),
                "world": self.layout.world,
                "redundant_experts": self.redundant_experts,
            },
            "workload": {
                "context": w.context,
                "batch": w.batch,
                "kv_dtype": w.kv_dtype,
                "kv_bytes_per_value": w.kv_bytes,
                "prefill_chunk": w.prefill_chunk,
                "chunk_tokens": w.chunk_tokens,
                "activation_bytes_per_value": ACT_BYTES,
            },
            "budget_bytes": self.budget,
            "device": self.device or None,
            "stages": [{"pp_rank": s, "layers": list(r)} for s, r in enumerate(self.stages)],
            "ranks": [
                {
                    "rank": r.rank,
                    "pp_rank": r.pp_rank,
                    "tp_rank": r.tp_rank,
                    "ep_rank": r.ep_rank,
                    "weights": r.weights,
                    "kv_cache": r.kv_cache,
                    "kda_state": r.kda_state,
                    "activations": r.activations,
                    "total": r.total,
                    "free": None if self.budget is None else self.budget - r.total,
                    "over": self.budget is not None and r.total > self.budget,
                }
                for r in self.ranks
            ],
            "totals": {c: sum(getattr(r, c) for r in self.ranks) for c in COMPONENTS},
            "peak_bytes": self.peak,
            "fits": self.fits,
            "over_ranks": self.over,
            "search": None
            if self.search is None
            else {"layouts": [f.to_json() for f in self.search], "note": self.search_note},
            "activations_are_estimates": True,
            "notes": self.notes,
            "warnings": self.warnings,
        }

    def table(self) -> str:
        lay, w, m = self.layout, self.workload, self.model
        lines = [
            f"{self.source}: {m['model_type']} ({m['arch']}), {m['layers']} layers "
            f"({m['attention']}); weights {m['weights_from']}",
            f"  layout: tp {lay.tp} x pp {lay.pp} = {lay.world} rank(s), moe_ep {lay.moe_ep} "
            f"(moe_tp {lay.moe_tp})"
            + (f", {self.redundant_experts} redundant expert(s)" if self.redundant_experts else "")
            + "; stages (layers): "
            + " ".join(f"[{a},{b})" for a, b in self.stages),
            f"  workload: context {w.context:,} tokens x batch {w.batch}, KV cache {w.kv_dtype}, "
            f"prefill chunk {w.chunk_tokens:,} tokens (activations: an estimate)",
            "  budget: "
            + (
                f"{human_bytes(self.budget, 2)} per device ({self.device})"
                if self.budget
                else "none given"
            ),
            "",
        ]
        head = [
            "rank(s)",
            "pp",
            "tp",
            "ep",
            "weights",
            "kv cache",
            "kda state",
            "activations",
            "total",
            "free",
            "FLAG",
        ]
        rows, prev = [], None
        for r in self.ranks:
            vals = (r.pp_rank, r.weights, r.kv_cache, r.kda_state, r.activations)
            if prev is not None and prev[0] == vals:
                prev[1].append(r)
                continue
            prev = (vals, [r])
            rows.append(prev)
        table = []
        for _vals, rs in rows:
            r = rs[0]
            span = f"{rs[0].rank}" if len(rs) == 1 else f"{rs[0].rank}-{rs[-1].rank}"
            tps = f"{rs[0].tp_rank}" if len(rs) == 1 else f"{rs[0].tp_rank}-{rs[-1].tp_rank}"
            eps = sorted({x.ep_rank for x in rs})
            ep = f"{eps[0]}" if len(eps) == 1 else f"{eps[0]}-{eps[-1]}"
            free = "-" if self.budget is None else human_bytes(self.budget - r.total, 2)
            flag = "" if self.budget is None else ("OVER" if r.total > self.budget else "ok")
            table.append(
                [
                    span,
                    str(r.pp_rank),
                    tps,
                    ep,
                    human_bytes(r.weights, 2),
                    human_bytes(r.kv_cache, 2),
                    human_bytes(r.kda_state, 2),
                    human_bytes(r.activations, 2),
                    human_bytes(r.total, 2),
                    free,
                    flag,
                ]
            )
        lines.append(_render(head, table))
        lines.append("")
        if self.budget is not None:
            if self.over:
                lines.append(
                    f"{len(self.over)} of {lay.world} rank(s) over budget (peak "
                    f"{human_bytes(self.peak, 2)} > {human_bytes(self.budget, 2)})."
                )
            else:
                lines.append(
                    f"fits: peak {human_bytes(self.peak, 2)} of "
                    f"{human_bytes(self.budget, 2)} per device."
                )
        if self.search is not None:
            if self.search:
                lines.append("smallest layouts that fit (by devices, then peak rank memory):")
                lines.append(
                    _render(
                        ["devices", "tp", "pp", "ep", "peak", "free"],
                        [
                            [
                                str(f.devices),
                                str(f.tp),
                                str(f.pp),
                                str(f.ep),
                                human_bytes(f.peak, 2),
                                human_bytes(f.budget - f.peak, 2),
                            ]
                            for f in self.search
                        ],
                    )
                )
            if self.search_note:
                lines.append(self.search_note)
        for n in self.notes:
            lines.append(f"note: {n}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


def _render(headers: list[str], rows: list[list[str]]) -> str:
    from .inspect import render_table

    return render_table(headers, rows)


class Planner:
    """Weights, caches and activations of every rank of any layout of one model."""

    def __init__(self, t: Tensors, workload: Workload, *, load=None, redundant: int = 0):
        self.t, self.w = t, workload
        self.weights = WeightModel(t)
        self.layers = LayerModel(t.cfg)
        self.load, self.redundant = load, redundant
        if redundant < 0:
            raise ConfigError(f"--redundant-experts must be 0 or more, got {redundant}.")
        self.num_experts = getattr(self.layers.text, "num_experts", 0) or 0

    def legal_ep(self, tp: int) -> list[int]:
        if not self.num_experts:
            return [1]
        slots = self.num_experts + self.redundant
        return [e for e in divisors(tp) if slots % e == 0]

    def check(self, layout: Layout) -> None:
        self.layers.check_tp(layout.tp)
        if self.num_experts and (self.num_experts + self.redundant) % layout.moe_ep:
            raise ConfigError(
                f"--ep {layout.moe_ep}: the {self.num_experts} routed experts + "
                f"{self.redundant} redundant copies do not spread evenly over {layout.moe_ep} "
                f"EP ranks; legal ep for tp={layout.tp}: {self.legal_ep(layout.tp)}."
            )
        if not self.num_experts and self.redundant:
            raise ConfigError("--redundant-experts was given but the model has no routed experts.")
        if layout.pp > self.layers.n:
            raise ConfigError(
                f"--pp {layout.pp} exceeds the model's {self.layers.n} decoder layers; use "
                f"pp <= {self.layers.n}."
            )

    def ranks(self, layout: Layout, pp_layers=None) -> tuple[list[RankMemory], list]:
        weights, ranges, _ = self.weights.per_rank(
            layout, pp_layers=pp_layers, load=self.load, redundant=self.redundant
        )
        L, w, tp, ep = self.layers, self.w, layout.tp, layout.moe_ep
        out = []
        for s, (a, b) in enumerate(ranges):
            kv = sum(L.kv_cache(i, tp, w) for i in range(a, b))
            kda = sum(L.kda_state(i, tp, w) for i in range(a, b))
            act = max((L.activations(i, tp, ep, w) for i in range(a, b)), default=0)
            if s == layout.pp - 1:
                act += L.logits(w)
            for t in range(tp):
                r = layout.rank(s, t)
                out.append(RankMemory(r, s, t, t // layout.moe_tp, weights[r], kv, kda, act))
        return out, ranges

    def lower_bound(self, tp: int, ep: int) -> int:
        """Memory some rank of every (tp, ep, any pp) layout needs at least: the heaviest
        single unit with its own layer's cache, state and activations."""
        lay = Layout(tp=tp, pp=1, moe_ep=ep)
        L, w, wm = self.layers, self.w, self.weights
        placed = wm.placement(lay, self.load, self.redundant)
        best = 0
        for u in wm.units:
            extra = 0
            kind, idx = unit_sort_key(u)
            if kind == 2:
                extra = L.kv_cache(idx, tp, w) + L.kda_state(idx, tp, w)
                extra += L.activations(idx, tp, ep, w)
            elif u == "head":
                extra = L.logits(w)
            best = max(best, max(wm.unit_vector(u, lay, placed)) + extra)
        return best

    def search(self, budget: int, top: int = 5) -> tuple[list[LayoutFit], str]:
        """The smallest layouts (devices = tp * pp) whose every rank fits ``budget``."""
        L = self.layers
        tps = L.legal_tp()
        pps = range(1, L.n + 1)
        cands = sorted((tp * pp, tp, pp) for tp in tps for pp in pps)
        fits: list[LayoutFit] = []
        pruned: set[tuple[int, int]] = set()
        bounds: dict[tuple[int, int], int] = {}
        skipped = 0
        for devices, tp, pp in cands:
            if len(fits) >= top and devices > fits[top - 1].devices:
                break
            for ep in self.legal_ep(tp):
                if (tp, ep) in pruned:
                    continue
                try:
                    if (tp, ep) not in bounds:
                        bounds[(tp, ep)] = self.lower_bound(tp, ep)
                    if bounds[(tp, ep)] > budget:
                        pruned.add((tp, ep))
                        continue
                    ranks, _ = self.ranks(Layout(tp=tp, pp=pp, moe_ep=ep))
                except K3Error:  # a split or placement this layout cannot do
                    pruned.add((tp, ep))
                    skipped += 1
                    continue
                peak = max(r.total for r in ranks)
                if peak <= budget:
                    fits.append(LayoutFit(tp, pp, ep, peak, budget))
            fits.sort(key=lambda f: (f.devices, f.peak))
        fits = fits[:top]
        note = ""
        if not fits:
            most = max(tps) * L.n
            note = (
                f"no layout fits {human_bytes(budget, 2)} per device: searched tp in {tps}, "
                f"pp up to {L.n}, ep dividing tp (up to {most} devices); every one has a rank over "
                f"budget - use a smaller --context / --batch, --kv-dtype fp8, a lower-bit "
                f"--scheme, or a larger device."
            )
        elif skipped:
            note = f"({skipped} tp/ep combination(s) skipped: the tensors cannot be split so)"
        return fits, note


def load_source(src: str | Path | None) -> Tensors:
    """A config.json, a model directory (its stored tensors when it has weights) or a
    bundled preset name."""
    from .checkpoint.output import refuse_partial
    from .synth import PRESETS, preset_config

    if src is None:
        raise ConfigError(
            "give SRC (a config.json, a model directory or a preset such as kimi-k3), or a "
            "--recipe whose source.path names the model."
        )
    p = Path(src)
    if p.exists():
        refuse_partial(p)  # an unfinished output (a stream without its manifest, too)
        if p.is_dir() and (p / "manifest.json").is_file():
            raise ConfigError(
                f"{p} is a stream directory (it has a manifest.json); plan from the "
                f"checkpoint it was sharded from, or its config.json."
            )
        if p.is_dir() and any(
            f.suffix in (".safetensors", ".bin", ".pt", ".pth") for f in p.iterdir()
        ):
            return checkpoint_tensors(p)
        raw = load_config(p)
        f = p / "config.json" if p.is_dir() else p
        return config_tensors(raw, str(f))
    if str(src) in PRESETS:
        return config_tensors(preset_config(str(src)), f"preset {src}")
    raise ConfigError(
        f"'{src}' is neither a config.json / model directory nor a preset ({', '.join(PRESETS)})."
    )


def _attention_label(L: LayerModel) -> str:
    counts = {k: L.kinds.count(k) for k in ("kda", "mla", "gqa") if k in L.kinds}
    return ", ".join(f"{n} {k.upper()}" for k, n in counts.items())


def plan_memory(
    *,
    src: str | Path | None = None,
    recipe=None,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    redundant_experts: int | None = None,
    pp_layers: Sequence[int] | None = None,
    expert_load=None,
    scheme: str | None = None,
    context: int | str | None = None,
    batch: int | None = None,
    kv_dtype: str = "bf16",
    prefill_chunk: int | str = 8192,
    device_mem: str | int | None = None,
    device: str | None = None,
    search: bool = True,
    top: int = 5,
    serving_device: str | None = None,
    strict_serving: bool = False,
) -> MemoryPlan:
    """The memory budget of every rank (see the module doc). ``recipe`` (a loaded
    :class:`k3convert.recipe.Recipe`): its ``source.path``, ``layout`` and ``quantize``
    sections are the defaults, and its ``target`` the device, context and batch (else
    131072 tokens x 1, no device); explicit arguments win (``scheme`` replaces the
    recipe's quantize section).
    A planned quantization is checked against vLLM on ``serving_device`` (None: the
    recipe's ``output.serving_device``, else cuda) at the layout's
    tp (:mod:`k3convert.serving`): ``warnings`` lists what it would refuse;
    ``strict_serving`` (or the recipe's ``output.strict_serving``) raises instead."""
    rec = recipe
    rlay = getattr(rec, "layout", None)
    if src is None and rec is not None:
        src = getattr(getattr(rec, "source", None), "path", None)
    tp = tp if tp is not None else getattr(rlay, "tp", 1)
    pp = pp if pp is not None else getattr(rlay, "pp", 1)
    ep = ep if ep is not None else getattr(rlay, "moe_ep", 1)
    if redundant_experts is None:
        redundant_experts = getattr(rlay, "redundant_experts", 0) or 0
    if pp_layers is None and getattr(rlay, "pp_layers", None):
        pp_layers = list(rlay.pp_layers)
    even_load = False
    if expert_load is None and rlay is not None and getattr(rlay, "expert_load", None):
        if rlay.expert_load == "calibration":  # measured by a run that has not happened:
            even_load = True  # equal counts, as convert plans before calibrating
        else:
            expert_load = rlay.expert_load
    target = getattr(rec, "target", None)
    if target is not None:
        if device is None and device_mem is None:
            device = target.device
        context = target.context if context is None else context
        batch = target.batch if batch is None else batch
    workload = Workload(
        context=parse_tokens(131072 if context is None else context, "--context"),
        batch=1 if batch is None else batch,
        kv_dtype=kv_dtype,
        prefill_chunk=parse_tokens(prefill_chunk, "--prefill-chunk"),
    )
    budget, label = device_budget(device_mem, device)
    if not isinstance(top, int) or top < 1:
        raise ConfigError(f"--top must be a positive integer, got {top!r}.")
    layout = Layout(tp=tp, pp=pp, moe_ep=ep)
    t = load_source(src)
    want = getattr(getattr(rec, "source", None), "model_type", None)
    if want is not None and t.config.get("model_type") != want:
        raise ConfigError(
            f"{rec.origin}: source.model_type is '{want}' but {src} is a "
            f"'{t.config.get('model_type')}' model; plan the model the recipe was written "
            f"for (or change source.model_type)."
        )
    if scheme is not None:
        t = quantized_tensors(t, scheme=scheme)
    elif rec is not None and rec.quantize is not None:
        t = quantized_tensors(t, recipe=rec)
    load = load_expert_load(expert_load)
    if even_load:
        n = getattr(getattr(t.cfg, "text", t.cfg), "num_experts", 0) or 0
        layers = {r.layer for r in t.roles if r.expert is not None}
        load = {L: [1.0] * n for L in layers} if layers else None
    planner = Planner(t, workload, load=load, redundant=redundant_experts)
    planner.check(layout)
    if pp_layers is not None and len(pp_layers) != layout.pp:
        raise ConfigError(
            f"--pp-layers lists {len(pp_layers)} stage(s) but --pp is {layout.pp}; give one "
            f"layer count per stage."
        )
    serving = []
    if t.qplan is not None:
        from .serving import ServingTarget

        out_sec = getattr(rec, "output", None)
        target = ServingTarget(
            tp=layout.tp, moe_ep=layout.moe_ep,
            device=serving_device or getattr(out_sec, "serving_device", "cuda"),
            strict=strict_serving or bool(getattr(out_sec, "strict_serving", False)),
        )  # fmt: skip
        serving = [f"serving: {p.line()}" for p in target.check(t.qplan, t.config)]
    ranks, ranges = planner.ranks(layout, pp_layers)
    L = planner.layers
    model = {
        "model_type": t.config.get("model_type"),
        "arch": t.arch.name,
        "layers": L.n,
        "attention": _attention_label(L),
        "weights_from": (
            "config (what synth writes for it)"
            if t.origin == "config"
            else "checkpoint (its stored tensors)"
        )
        + (f", quantized by {t.quantized}" if t.quantized else ""),
        "tensors": len(t.names),
    }
    plan = MemoryPlan(
        source=str(src),
        model=model,
        layout=layout,
        redundant_experts=redundant_experts,
        workload=workload,
        stages=ranges,
        ranks=ranks,
        budget=budget,
        device=label,
        warnings=serving,
    )
    if "mla" in L.kinds and layout.tp > 1:
        plan.notes.append("the MLA latent cache is replicated on every TP rank of a stage.")
    if "kda" in L.kinds:
        plan.notes.append(
            "KDA layers keep a fixed state per sequence (float32 recurrent state + bf16 conv "
            "inputs) that does not grow with the context."
        )
    if getattr(L.text, "num_mtp", 0):
        plan.notes.append("MTP layers' weights are counted; their KV cache is not.")
    if budget is not None and search:
        plan.search, plan.search_note = planner.search(budget, top)
    return plan


def plot_plan(plan: MemoryPlan, path: str | Path) -> Path:
    """A PNG of per-rank memory stacked by component, the budget as a line. Needs
    matplotlib (a test extra): a ConfigError says so when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed; `pip install matplotlib` (or "
            "the project's test extra), or leave --plot out."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {out}: the directory {out.parent} does not exist.")
    top = max([r.total for r in plan.ranks] + [plan.budget or 0])
    unit, gib = next(
        (u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= b
    )
    ranks = [r.rank for r in plan.ranks]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * len(ranks) + 4), 4.5))
    bottom = [0.0] * len(ranks)
    colors = {
        "weights": "#4C72B0",
        "kv_cache": "#DD8452",
        "kda_state": "#55A868",
        "activations": "#C44E52",
        "free": "#DDDDDD",
    }
    labels = {
        "weights": "weights",
        "kv_cache": "KV cache",
        "kda_state": "KDA state",
        "activations": "activations (estimate)",
        "free": "free",
    }
    for comp in COMPONENTS:
        vals = [getattr(r, comp) / gib for r in plan.ranks]
        ax.bar(ranks, vals, bottom=bottom, color=colors[comp], label=labels[comp])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if plan.budget is not None:
        free = [max(0.0, plan.budget / gib - b) for b in bottom]
        ax.bar(ranks, free, bottom=bottom, color=colors["free"], label=labels["free"])
        ax.axhline(
            plan.budget / gib,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"budget {plan.budget / gib:.1f} {unit}",
        )
    lay = plan.layout
    ax.set_title(
        f"{plan.model['model_type']}: tp {lay.tp} x pp {lay.pp}, ep {lay.moe_ep}; "
        f"context {plan.workload.context:,} x batch {plan.workload.batch}"
    )
    ax.set_xlabel("rank")
    ax.set_ylabel(unit)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xticks(ranks, [str(r) for r in ranks], fontsize=8 if len(ranks) <= 32 else 5)
    if plan.budget is not None:  # ranks over budget: red labels
        for lbl, r in zip(ax.get_xticklabels(), plan.ranks, strict=True):
            if r.total > plan.budget:
                lbl.set_color("red")
    fig.tight_layout()
    try:
        fig.savefig(out, format="png", dpi=100)
    except OSError as e:
        raise ConfigError(f"--plot {out}: cannot write ({e.strerror or e}).") from e
    finally:
        plt.close(fig)
    return out
