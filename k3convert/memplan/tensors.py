"""The tensors a source stores, or would store: a checkpoint's own, what ``synth``
writes for a config alone, what ``quantize`` would write from either."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..arch import resolve, validate_source
from ..arch.base import Arch, Instance, Role, role_of, scope_indices, stored_shape_of
from ..checkpoint import Checkpoint, PartMeta, TensorMeta, open_checkpoint
from ..checkpoint.reader import QuantConfig
from ..formats import detect_encoding
from ..formats.dtypes import SHORT_DTYPES, SHORT_NAMES
from ..quant import planning
from ..quant.rules import resolve as resolve_rules
from ..quant.schemes import get_scheme
from ..synth import encoding_for, output_config, plan_instance, text_section


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
    src = str(text_section(raw).get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "")
    name = SHORT_NAMES.get(src, "bf16")
    return SHORT_DTYPES[name], name


def _instances(arch: Arch, cfg: Any):
    """``arch.instances(cfg)`` (MTP layers included), with each row's shape computed once
    instead of once per layer and expert (a quarter of a million tensors for Kimi K3)."""
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
