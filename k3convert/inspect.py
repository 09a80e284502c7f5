"""``k3convert inspect``: what a checkpoint (or a config.json alone) contains.

With weights, every tensor is classified by the architecture table and checked against
the shape the config implies; parameters and bytes are summed by component, by stored
dtype and by encoding. With a config.json alone the same table gives the parameter
arithmetic, so a team can size a 1 T / 3 T release before downloading it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .arch import COMPONENTS, kv_cache_scheme_of, load_config, resolve, validate_source
from .checkpoint import open_checkpoint
from .checkpoint.output import refuse_partial
from .errors import ConfigError
from .quant.rules import is_linear_weight
from .stream import load_manifest
from .stream.format import is_stream_dir
from .units import human_bytes

_CONFIG_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def _describe(cfg: Any) -> dict[str, Any]:
    text = getattr(cfg, "text", cfg)
    n = text.num_layers
    moe = [i for i in range(n) if text.is_moe_layer(i)]
    d: dict[str, Any] = {
        "layers": n,
        "moe_layers": len(moe),
        "dense_layers": n - len(moe),
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "attention_heads": text.num_heads,
        "tie_word_embeddings": text.tie_word_embeddings,
    }
    if text.num_experts:
        d["experts"] = {
            "routed": text.num_experts,
            "active": text.num_experts_per_tok,
            "shared": getattr(text, "num_shared_experts", 0),
        }
    if hasattr(text, "kv_lora_rank"):
        d["mla"] = {
            "q_lora_rank": text.q_lora_rank,
            "kv_lora_rank": text.kv_lora_rank,
            "qk_nope_head_dim": text.qk_nope_head_dim,
            "qk_rope_head_dim": text.qk_rope_head_dim,
            "v_head_dim": text.v_head_dim,
        }
        d["mtp_layers"] = text.num_mtp
        if hasattr(text, "kda_layers"):  # a KDA + MLA hybrid (kimi_linear, Kimi K3)
            d["kda"] = {
                "layers": len(text.kda_layers),
                "mla_layers": n - len(text.kda_layers),
                "heads": text.kda_num_heads,
                "head_dim": text.kda_head_dim,
                "conv_kernel": text.conv_kernel,
            }
            if text.latent_size:
                d["latent_moe"] = text.latent_size
            if text.attn_res_block_size:
                d["attn_res_block_size"] = text.attn_res_block_size
    else:
        d["kv_heads"] = text.num_kv_heads
    vision = getattr(cfg, "vision", None)
    if vision is not None:
        d["vision"] = {
            "blocks": vision.num_layers,
            "hidden_size": vision.hidden_size,
            "patch_size": vision.patch_size,
        }
    return d


def _linear_module(name: str, role) -> bool:
    """A Linear a quantization_config's targets could mean (not a router, embedding, head,
    norm or MTP tensor, which releases keep in high precision by design)."""
    return (
        not role.mtp
        and role.component not in ("router", "head", "embeddings", "norms")
        and is_linear_weight(name, (1, 1), role)
    )


def _active_fraction(cfg: Any) -> float:
    text = getattr(cfg, "text", cfg)
    return text.num_experts_per_tok / text.num_experts if text.num_experts else 1.0


def inspect_path(*, path: str | Path, tensors: bool = False, keep_mtp: bool = True) -> dict:
    """Report for a model directory, a config.json file (no weights needed) or a bundled
    preset's name (``kimi-k3``: the release's published config, as ``plan`` takes it)."""
    from .synth import PRESETS, preset_config

    p = Path(path)
    if is_stream_dir(p):
        return _inspect_stream(p, tensors=tensors, keep_mtp=keep_mtp)
    preset = not p.exists() and str(path) in PRESETS
    config_only = preset or (p.is_file() and p.suffix == ".json")
    if p.is_dir() and not any(
        f.suffix in (".safetensors", ".bin", ".pt", ".pth") for f in p.iterdir()
    ):  # a directory holding only config.json
        config_only = True
    if not p.exists() and not preset:
        raise ConfigError(
            f"{path}: no such file or directory, and not a preset ({', '.join(PRESETS)})."
        )
    if config_only:
        if preset:
            raw = preset_config(str(path))
            arch, cfg = resolve(raw, f"preset {path}")
        else:
            refuse_partial(p)  # open_checkpoint does the same for the other branch
            raw = load_config(p)
            arch, cfg = resolve(raw, str(p))
        rows = [(i.name, i.shape, None, i.role) for i in arch.instances(cfg, mtp=keep_mtp)]
        ckpt = None
    else:
        ckpt = open_checkpoint(p)
        arch, cfg = resolve(ckpt.config, str(Path(ckpt.root) / "config.json"))
        names = ckpt.names()
        # the same validation as every other verb; missing tensors are reported, not fatal
        matched = validate_source(arch, cfg, ckpt, str(ckpt.root), complete=False)
        rows = [(n, ckpt.meta(n).shape, ckpt.meta(n), matched[n].role) for n in names]
        if not keep_mtp:
            rows = [r for r in rows if not r[3].mtp]
    raw_cfg = ckpt.config if ckpt else raw
    report: dict[str, Any] = {
        "path": str(p),
        "model_type": raw_cfg.get("model_type"),
        "arch": arch.name,
        "alias_of": arch.name if raw_cfg.get("model_type") != arch.name else None,
        "config_only": ckpt is None,
        **_describe(cfg),
    }
    frac = _active_fraction(cfg)
    by_comp: dict[str, dict[str, int]] = defaultdict(lambda: {"params": 0, "bytes": 0})
    by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: {"params": 0, "bytes": 0})
    by_enc: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    total = active = mtp_params = 0
    table = []
    elt = _CONFIG_DTYPE_BYTES.get(str(raw_cfg.get("torch_dtype") or raw_cfg.get("dtype")), 2)
    for name, shape, meta, role in rows:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = meta.nbytes if meta else numel * elt
        comp = by_comp[role.component]
        comp["params"] += numel
        comp["bytes"] += nbytes
        if meta:
            by_dtype[meta.storage]["params"] += numel
            by_dtype[meta.storage]["bytes"] += nbytes
            by_enc[meta.encoding]["tensors"] += 1
            by_enc[meta.encoding]["bytes"] += nbytes
        if role.mtp:
            mtp_params += numel
        else:
            total += numel
            active += numel * frac if role.component == "routed_experts" else numel
        if tensors:
            table.append(
                {
                    "name": name,
                    "shape": list(shape),
                    "storage": meta.storage if meta else None,
                    "encoding": meta.encoding if meta else None,
                    "component": role.component,
                    "kind": role.kind,
                    "layer": role.layer,
                    "expert": role.expert,
                    "split": role.split,
                    "keep": role.keep,
                }
            )
    report["total_params"] = total
    report["active_params"] = round(active)
    report["mtp_params"] = mtp_params
    report["tensors_count"] = len(rows)
    report["by_component"] = {c: dict(by_comp[c]) for c in COMPONENTS if c in by_comp}
    if ckpt is not None:
        report["total_bytes"] = sum(v["bytes"] for v in by_comp.values())
        report["by_dtype"] = {k: dict(v) for k, v in sorted(by_dtype.items())}
        report["by_encoding"] = {k: dict(v) for k, v in sorted(by_enc.items())}
        report["files"] = len(ckpt.files())
        report["aux_files"] = [f.name for f in ckpt.aux_files]
        # quantization_config claims a format for these, the files store them plain (the
        # K3 release's ignore list misses some bf16 Linears): read as stored
        report["claimed_but_plain"] = [
            {"tensor": n, "claimed": fmt}
            for n, fmt in getattr(ckpt, "claimed_plain", [])
            if n in matched and _linear_module(n, matched[n].role)
        ]
        if keep_mtp:
            present = {matched[r[0]].canonical for r in rows}
            missing = [i.name for i in arch.instances(cfg, mtp=False) if i.name not in present]
            report["missing"] = missing
    else:
        report["est_bytes_at_config_dtype"] = sum(v["bytes"] for v in by_comp.values())
    kv = _kv_cache(raw_cfg, cfg, ckpt, rows)
    if kv is not None:
        report["kv_cache"] = kv
    if tensors:
        report["tensors"] = table
    return report


def _kv_cache(raw: dict, cfg: Any, ckpt, rows) -> dict | None:
    """The calibrated KV-cache quantization: the config's kv_cache_scheme and, with
    weights, the per-layer k_scale / v_scale tensors (their range)."""
    scheme = kv_cache_scheme_of(raw)
    scales = [(n, role) for n, _, _, role in rows if role.kind in ("k_scale", "v_scale")]
    if scheme is None and not scales:
        return None
    text = getattr(cfg, "text", cfg)
    kda = getattr(text, "is_kda_layer", None)
    attn = [i for i in range(text.num_layers) if kda is None or not kda(i)]
    out: dict[str, Any] = {"scheme": scheme, "attention_layers": len(attn)}
    if ckpt is not None:
        out["layers_with_scales"] = len({r.layer for _, r in scales if not r.mtp})
        for kind in ("k_scale", "v_scale"):
            vals = [float(ckpt.get(n, None).float().reshape(-1)[0]) for n, r in scales
                    if r.kind == kind and ckpt.meta(n).shape == (1,)]  # fmt: skip
            out[kind] = [min(vals), max(vals)] if vals else None
    return out


def _kv_line(kv: dict) -> str:
    sc = kv["scheme"]
    if isinstance(sc, dict):
        what = (
            f"{sc.get('type', '?')}{sc.get('num_bits', '?')} "
            f"{sc.get('strategy', '?')} {'dynamic' if sc.get('dynamic') else 'static'}"
        )
    else:
        what = "no kv_cache_scheme in the config"
    line = f"  KV cache: {what}"
    if "layers_with_scales" in kv:
        line += (
            f", scales on {kv['layers_with_scales']} of {kv['attention_layers']} attention layers"
        )
        for kind in ("k_scale", "v_scale"):
            if kv.get(kind):
                lo, hi = kv[kind]
                line += f"; {kind} {lo:.3g}..{hi:.3g}"
    else:
        line += f" ({kv['attention_layers']} attention layers)"
    return line


def _inspect_stream(p: Path, *, tensors: bool, keep_mtp: bool) -> dict:
    """A stream directory: the model's arithmetic from its config, plus its layout."""
    manifest = load_manifest(p)
    report = inspect_path(path=p / "config.json", tensors=tensors, keep_mtp=keep_mtp)
    lay = manifest["layout"]
    units = [u for r in manifest["ranks"] for u in r["units"]]
    report["path"] = str(p)
    report["stream"] = {
        "tp": lay["tp"],
        "pp": lay["pp"],
        "moe_tp": lay["moe_tp"],
        "moe_ep": lay["moe_ep"],
        "world": lay["world"],
        "units": len(units),
        "bytes": sum(u["bytes"] for u in units),
        "raw_bytes": sum(u["raw_bytes"] for u in units),
        "compression": sorted({u["compression"] for u in units}),
    }
    return report


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000
    return f"{n}"


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """Human-readable rendering of :func:`inspect_path`'s report."""
    return "\n".join(["\n".join(_summary(r)), "", *_tables(r)])


def _summary(r: dict) -> list[str]:
    """The report's summary lines: the model, its attention / experts / vision, the
    parameters, what is stored."""
    head = [
        f"{r['path']}: {r['model_type']}" + (f" (alias of {r['arch']})" if r["alias_of"] else "")
    ]
    head.append(
        f"  layers {r['layers']} ({r['dense_layers']} dense, {r['moe_layers']} MoE), hidden "
        f"{r['hidden_size']}, vocab {r['vocab_size']}, heads {r['attention_heads']}"
        + (f", kv heads {r['kv_heads']}" if "kv_heads" in r else "")
    )
    if "experts" in r:
        e = r["experts"]
        head.append(f"  experts: {e['routed']} routed, {e['active']} active, {e['shared']} shared")
    if "mla" in r:
        m = r["mla"]
        head.append(
            f"  MLA: q_lora {m['q_lora_rank']}, kv_lora {m['kv_lora_rank']}, qk nope/rope "
            f"{m['qk_nope_head_dim']}/{m['qk_rope_head_dim']}, v {m['v_head_dim']}; "
            f"MTP layers {r.get('mtp_layers', 0)}"
        )
    if "kda" in r:
        k = r["kda"]
        head.append(
            f"  KDA: {k['layers']} linear-attention layers + {k['mla_layers']} MLA layers, "
            f"{k['heads']} heads x {k['head_dim']}, conv {k['conv_kernel']}"
            + (f"; latent MoE width {r['latent_moe']}" if "latent_moe" in r else "")
            + (
                f"; attention residuals every {r['attn_res_block_size']} layers"
                if "attn_res_block_size" in r
                else ""
            )
        )
    if "kv_cache" in r:
        head.append(_kv_line(r["kv_cache"]))
    if "vision" in r:
        v = r["vision"]
        head.append(
            f"  vision: {v['blocks']} blocks, hidden {v['hidden_size']}, patch {v['patch_size']}"
        )
    head.append(
        f"  parameters: {human(r['total_params'])} total, {human(r['active_params'])} active "
        f"per token" + (f", {human(r['mtp_params'])} in MTP layers" if r["mtp_params"] else "")
    )
    if "stream" in r:
        st = r["stream"]
        head.append(
            f"  stream: tp {st['tp']} x pp {st['pp']} (moe_tp {st['moe_tp']}, moe_ep "
            f"{st['moe_ep']}), {st['world']} ranks, {st['units']} units, "
            f"{human_bytes(st['bytes'])} stored ({human_bytes(st['raw_bytes'])} raw, "
            f"{'/'.join(st['compression'])}); verify with `k3convert shard --check`"
        )
    elif r["config_only"]:
        head.append(
            f"  (config only; bytes estimated at the config dtype: "
            f"{human_bytes(r['est_bytes_at_config_dtype'])})"
        )
    else:
        head.append(
            f"  stored: {human_bytes(r['total_bytes'])} in {r['files']} file(s), "
            f"{r['tensors_count']} tensors; carried files: {', '.join(r['aux_files']) or 'none'}"
        )
        if r.get("missing"):
            head.append(
                f"  warning: {len(r['missing'])} tensor(s) the config implies are absent, "
                f"e.g. {r['missing'][0]}"
            )
        claimed = r.get("claimed_but_plain") or []
        if claimed:
            fmts = sorted({c["claimed"] for c in claimed})
            head.append(
                f"  note: quantization_config claims {', '.join(fmts)} for {len(claimed)} "
                f"tensor(s) the files store plain (e.g. {claimed[0]['tensor']}); they are "
                f"read as stored"
            )
    return head


def _tables(r: dict) -> list[str]:
    """The report's tables: by component, dtype, encoding, and (``--tensors``) per tensor."""
    out = []
    rows = [
        [
            c,
            human(v["params"]),
            f"{100 * v['params'] / max(r['total_params'] + r['mtp_params'], 1):.1f}%",
            human_bytes(v["bytes"]),
        ]
        for c, v in r["by_component"].items()
    ]
    out.append(
        render_table(
            ["component", "params", "share", "bytes" if not r["config_only"] else "est. bytes"],
            rows,
        )
    )
    if not r["config_only"]:
        out.append("")
        out.append(
            render_table(
                ["stored as", "params", "bytes"],
                [
                    [k, human(v["params"]), human_bytes(v["bytes"])]
                    for k, v in r["by_dtype"].items()
                ],
            )
        )
        out.append("")
        out.append(
            render_table(
                ["encoding", "tensors", "bytes"],
                [
                    [k, str(v["tensors"]), human_bytes(v["bytes"])]
                    for k, v in r["by_encoding"].items()
                ],
            )
        )
    if "tensors" in r:
        out.append("")
        trows = [
            [
                t["name"],
                "x".join(map(str, t["shape"])),
                t["storage"] or "-",
                t["encoding"] or "-",
                t["component"],
                t["kind"],
                "-" if t["layer"] is None else str(t["layer"]),
                "-" if t["expert"] is None else str(t["expert"]),
                t["split"],
                "keep" if t["keep"] else "",
            ]
            for t in r["tensors"]
        ]
        out.append(
            render_table(
                [
                    "tensor",
                    "shape",
                    "stored",
                    "encoding",
                    "component",
                    "kind",
                    "layer",
                    "expert",
                    "tp split",
                    "precision",
                ],
                trows,
            )
        )
    return out
