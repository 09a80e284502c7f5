"""``k3convert verify``: run a candidate the way the cluster will and compare it with a
reference, layer by layer, then (optionally) check incremental decoding.

Candidate: a stream directory (every rank, as its manifest lays them out), or a
checkpoint (original or quantized) cut on the fly for ``--layout`` by the shard planner.
Reference: by default the unsharded, unquantized original the candidate was made from
(followed through the provenance the stream / quantized checkpoint records), run by our
own runtime; ``transformers`` runs transformers' model instead (optional dependency).

Both run in lockstep, one layer at a time, so per-layer hidden-state errors cost no
memory beyond two hidden states. Under ``torchrun`` every process runs its own rank
(``torch.distributed``), rank 0 runs the reference and writes the report.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..arch import resolve
from ..errors import CheckpointError, ConfigError, K3Error, NonFiniteError
from ..layout import Layout
from ..parallel import (
    SimulatedCollectives,
    TorchDistributedCollectives,
    init_distributed,
    under_torchrun,
)
from ..runtime.cache import KVCache
from ..runtime.parallel import ParallelRuntime
from ..runtime.ranks import planned_ranks, stream_ranks
from ..runtime.runtime import Runtime, parse_dtype
from ..stream.format import StreamCorruptError
from . import inputs as vin
from . import metrics as vm

#: decode check where bit-exactness cannot hold (FP8 KV cache, dynamic activation
#: scales): mean KL(full forward || incremental decode) limit
FP8_KV_MAX_KLD = 0.05


def parse_layout(text: str | None) -> Layout | None:
    """``tp=4,pp=2,ep=2`` (also ``moe_tp``) -> Layout."""
    if text is None:
        return None
    kw: dict[str, int] = {}
    names = {"tp": "tp", "pp": "pp", "ep": "moe_ep", "moe_ep": "moe_ep", "moe_tp": "moe_tp"}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in names:
            raise ConfigError(
                f"--layout '{text}': '{item}' is not key=value with key one of tp, pp, ep, "
                f"moe_tp (e.g. --layout tp=4,pp=2,ep=2)."
            )
        try:
            kw[names[k.strip()]] = int(v)
        except ValueError:
            raise ConfigError(f"--layout '{text}': '{v}' is not an integer.") from None
    return Layout(**kw)


def _check_output(flag: str, out) -> None:
    """A report path must be writable before any work starts (not after an hour)."""
    if out is None:
        return
    p = Path(out)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {p}: is a directory; give a file name.")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {p}: the directory {parent} does not exist.")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {p}: the directory {parent} is not writable.")


def _peak_rss_mib() -> float:
    """This process's peak RSS. Linux: VmHWM (ru_maxrss survives exec, so a process
    started by a large parent would report the parent's peak)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _is_stream(p: Path) -> bool:
    return p.is_dir() and (p / "manifest.json").is_file()


def _open_candidate(
    path: Path, layout: Layout | None, check_stream: bool, placement: dict, only_rank=None
):
    """(RankSet, kind, source path of provenance or None)."""
    from ..checkpoint import open_checkpoint
    from ..stream import open_stream

    if _is_stream(path) or (path.is_dir() and (path / "journal").is_dir()):
        if layout is not None or any(placement.values()):
            raise ConfigError(
                f"{path}: a stream directory carries its own layout and expert placement; "
                f"drop --layout / --pp-layers / --expert-load / --redundant-experts (they are "
                f"for a checkpoint cut on the fly)."
            )
        if check_stream:
            from ..stream.check import check

            rep = check(path, ranks=None if only_rank is None else {only_rank})
            if rep.status == "not_stream":
                raise ConfigError(rep.problems[0] if rep.problems else f"{path}: not a stream.")
            if not rep.ok:
                shown = "; ".join(p.rstrip(". ") for p in rep.problems[:3])
                more = f" (and {len(rep.problems) - 3} more)" if len(rep.problems) > 3 else ""
                raise StreamCorruptError(
                    f"{path}: the stream is damaged, nothing was run: {shown}{more}. Re-run "
                    f"`k3convert shard` or re-copy the stream."
                )
        st = open_stream(path, verify_hashes=not check_stream)
        prov = st.manifest.get("source", {}).get("path")
        return stream_ranks(st), "stream", prov
    ck = open_checkpoint(path)
    # a quantized checkpoint names its source; an original is its own reference (run
    # unsharded), so `verify CKPT --layout ...` checks the layout alone
    prov = (ck.config.get("k3convert") or {}).get("source") or str(path)
    return planned_ranks(ck, layout or Layout(), **placement), "checkpoint", prov


def _original(path: Path, seen: int = 0) -> tuple[Path, str | None]:
    """Follow quantize's provenance (``config.json: k3convert.source``) to the
    unquantized original, where it still exists: (path, a note when it does not)."""
    from ..checkpoint import load_json

    cfg_path = path / "config.json"
    if seen > 4 or not cfg_path.is_file():
        return path, None
    cfg = load_json(cfg_path)
    src = (cfg.get("k3convert") or {}).get("source")
    if src and cfg.get("quantization_config") is not None:
        p = Path(src)
        if p.is_dir() and (p / "config.json").is_file():
            return _original(p, seen + 1)
        return path, (
            f"the quantized checkpoint's own source {p} is not there, so the reference is the "
            f"quantized checkpoint {path} itself (this checks the layout, not the "
            f"quantization); pass --reference ORIGINAL to compare with the original"
        )
    return path, None


def _resolve_reference(
    reference: str | None, prov: str | None, candidate: Path
) -> tuple[str, Path, str | None]:
    """(kind, path, note) of the reference: kind "runtime" or "transformers"."""
    if reference is not None and reference != "transformers":
        p = Path(reference)
        if not p.exists():
            raise ConfigError(f"--reference {p}: no such checkpoint directory.")
        return "runtime", p, None
    if prov is None:
        raise ConfigError(
            f"{candidate}: records no source checkpoint to compare against; give one with "
            f"--reference PATH."
        )
    p = Path(prov)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{candidate}: its provenance names the source checkpoint {p}, which is not there "
            f"(moved or on another machine?); give it with --reference PATH."
        )
    p, note = _original(p)
    return ("transformers" if reference == "transformers" else "runtime"), p, note


_COMPARED = (
    "arch", "num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads",
    "num_experts", "num_experts_per_tok", "head_dim", "kv_lora_rank", "q_lora_rank",
)  # fmt: skip


def _check_same_model(cand_cfg: dict, ref_cfg: dict, cand: str, ref: str) -> None:
    a_arch, a = resolve(cand_cfg, f"{cand}/config.json")
    b_arch, b = resolve(ref_cfg, f"{ref}/config.json")
    ta, tb = getattr(a, "text", a), getattr(b, "text", b)
    va = {"arch": a_arch.name, **{k: getattr(ta, k, None) for k in _COMPARED[1:]}}
    vb = {"arch": b_arch.name, **{k: getattr(tb, k, None) for k in _COMPARED[1:]}}
    diff = [k for k in _COMPARED if va[k] != vb[k]]
    if diff:
        k = diff[0]
        raise ConfigError(
            f"the reference {ref} is not the candidate's model: {k} is {vb[k]} there but "
            f"{va[k]} in {cand}; pass the checkpoint the candidate was made from with "
            f"--reference."
        )


#: the "exact" family in a 16-bit compute dtype: each rank's partial sum is rounded to
#: bf16 / fp16 before the all-reduce, so a reshard is exact only to that precision
LOW_PRECISION_EXACT = {
    torch.bfloat16: vm.Thresholds(max_kld=1e-3, min_top1=0.9, max_rel_err=5e-2,
                                  kind="resharding-bf16"),
    torch.float16: vm.Thresholds(max_kld=1e-4, min_top1=0.95, max_rel_err=1e-2,
                                 kind="resharding-fp16"),
}  # fmt: skip


def _thresholds(
    cand_cfg: dict, ref_cfg: dict, layout: Layout, compute: torch.dtype, max_kld, min_top1,
    max_rel_err,
):  # fmt: skip
    qc = cand_cfg.get("quantization_config") or (cand_cfg.get("text_config") or {}).get(
        "quantization_config"
    )
    rq = ref_cfg.get("quantization_config") or (ref_cfg.get("text_config") or {}).get(
        "quantization_config"
    )
    if qc is None or (qc == rq and (layout.tp == 1 or not _dynamic_acts(qc))):
        th = LOW_PRECISION_EXACT.get(compute) or vm.default_thresholds("exact")
    else:
        th = vm.thresholds_for_quant_config(cand_cfg)
    over = {k: v for k, v in (("max_kld", max_kld), ("min_top1", min_top1),
                              ("max_rel_err", max_rel_err)) if v is not None}  # fmt: skip
    if over:
        th = vm.Thresholds(**{**asdict(th), **over, "kind": f"{th.kind} + flags"})
    return th


def _dynamic_acts(qc: dict) -> bool:
    for g in (qc.get("config_groups") or {}).values():
        ia = (g or {}).get("input_activations") or {}
        if ia and ia.get("dynamic", False):
            return True
    return False


class _Lockstep:
    """Runs the reference one layer behind nothing: each candidate layer output is
    compared with the reference's, which advances in step."""

    def __init__(self, ref: Runtime, ids, mask, pv, grid, pos, progress):
        self.ref, self.mask, self.pos = ref, mask, pos
        self.h = ref.embed(ids, pixel_values=pv, image_grid_thw=grid)
        self.layers: list[dict] = []
        self.bar = progress

    def __call__(self, i: int, h: torch.Tensor | None) -> None:
        self.h = self.ref.run_layer(i, self.h, self.pos, self.mask)
        if h is not None:
            err = vm.rel_l2(self.h.float(), h.float())
            self.layers.append({"layer": i, "rel_l2": _finite_or_none(err)})
        if self.bar is not None:
            self.bar.update(1)

    def logits(self) -> torch.Tensor:
        return self.ref.head(self.h)


def _need_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--reference transformers needs the transformers package (pip install "
            "transformers); or drop it to use k3convert's own runtime as the reference."
        ) from None
    return transformers


def _transformers_reference(path: Path, ids, mask, pv, grid) -> tuple[torch.Tensor, list]:
    transformers = _need_transformers()
    from ..checkpoint import load_json

    cfg = load_json(path / "config.json")
    auto = (
        transformers.AutoModelForImageTextToText
        if cfg.get("model_type") == "kimi_k25"
        else transformers.AutoModelForCausalLM
    )
    try:
        model = auto.from_pretrained(
            path, torch_dtype=torch.float32, trust_remote_code=False, local_files_only=True
        ).eval()
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: transformers cannot load this checkpoint ({e}).") from e
    kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    if pv is not None:
        kw.update(pixel_values=pv, image_grid_thw=grid)
    with torch.no_grad():
        out = model(**kw)
    hs = out.hidden_states
    # hidden_states[i + 1] follows layer i, except the last, which transformers returns
    # after the final norm: layers 0 .. L-2 are comparable
    return out.logits.float(), list(hs[1:-1])


def _fidelity_of(cand: Path) -> dict | None:
    """What the conversion that made ``cand`` did to the release's values: its loss report
    (``transcode_report.json``, written by quantize / convert and carried by shard), in
    brief; None where the candidate has none (a source that was not re-encoded)."""
    from ..quant import fidelity

    f = cand / fidelity.FILE
    if not f.is_file():
        return None
    try:
        rep = fidelity.LossReport.from_json(json.loads(f.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        return {"file": str(f), "error": f"unreadable: {e}"}
    return {"file": str(f), "tensors": len(rep), "exact": len(rep.exact),
            "worst": [e.name for e in rep.worst(3)], "summary": rep.summary()}  # fmt: skip


def run_verify(
    *,
    candidate,
    reference: str | None = None,
    layout: str | Layout | None = None,
    data=None,
    random: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    pixel_values=None,
    decode: int = 0,
    kv_cache: str | None = None,
    mla_cache: str = "expanded",
    max_kld: float | None = None,
    min_top1: float | None = None,
    max_rel_err: float | None = None,
    json_path=None,
    plot_path=None,
    dtype: str = "fp32",
    device: str = "cpu",
    pp_layers=None,
    expert_load=None,
    redundant_experts: int = 0,
    resident: bool = False,
    check_stream: bool = True,
    progress: bool = True,
    distributed: bool | None = None,
) -> dict:
    """Run the check; returns the report (``report["passed"]``). Under torchrun only rank
    0's report is complete (``report["rank"]`` says which). pp_layers / expert_load /
    redundant_experts: the placement for a checkpoint cut on the fly, as ``shard`` takes
    them. resident: keep the candidate's weights in memory (fast decoding of small
    models); default streams them, layer by layer, on every forward and decode step.
    distributed: False runs every rank in this process even under torchrun (convert's
    process 0 does, after the others have written their units); None: torchrun decides."""
    t_start = time.perf_counter()
    cand_path = Path(candidate)
    if not cand_path.exists():
        raise ConfigError(f"{cand_path}: no such candidate (a stream directory or a checkpoint).")
    lay = parse_layout(layout) if isinstance(layout, str) or layout is None else layout
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"--seq-len must be a positive integer, got {seq_len!r}.")
    if not isinstance(decode, int) or decode < 0:
        raise ConfigError(f"--decode must be a non-negative integer, got {decode!r}.")
    if not isinstance(random, int) or random < 1:
        raise ConfigError(f"--random must be a positive number of sequences, got {random!r}.")
    compute = parse_dtype(dtype)
    for flag, out in (("--json", json_path), ("--plot", plot_path)):
        _check_output(flag, out)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib).") from None
    if decode:
        KVCache(mla=mla_cache, kv_dtype=kv_cache)  # bad values fail here, before any work
    elif kv_cache is not None or mla_cache != "expanded":
        raise ConfigError(
            "--kv-cache / --mla-cache choose the decode check's cache; add --decode N."
        )
    dist_run = under_torchrun() if distributed is None else distributed
    if dist_run:
        from ..device import resolve_device

        init_distributed(resolve_device(device))
    placement = dict(
        pp_layers=pp_layers, expert_load=expert_load, redundant_experts=redundant_experts
    )
    me = 0
    if dist_run:
        import torch.distributed as dist

        me = dist.get_rank()
    err = None
    try:
        only = me if dist_run else None
        ranks, cand_kind, prov = _open_candidate(cand_path, lay, check_stream, placement, only)
    except K3Error as e:
        err = e
    if dist_run:  # each process checked its own rank's units: agree on the verdict
        from ..parallel.collectives import process_flags

        failed = process_flags(err is not None)
        if err is None and any(failed):
            err = StreamCorruptError(
                f"{cand_path}: torchrun process {failed.index(True)} could not open or "
                f"check its part of the candidate (its error is printed above); nothing "
                f"was run."
            )
    if err is not None:
        raise err
    ref_kind, ref_path, ref_note = _resolve_reference(reference, prov, cand_path)
    from ..checkpoint import load_json, open_checkpoint

    ref_cfg = load_json(ref_path / "config.json")
    _check_same_model(ranks.config, ref_cfg, str(cand_path), str(ref_path))
    th = _thresholds(ranks.config, ref_cfg, ranks.layout, compute, max_kld, min_top1, max_rel_err)

    if dist_run:
        groups = [ranks.tp_group(s.pp_rank) for s in ranks.stages]
        coll = TorchDistributedCollectives(ranks.world, groups, resolve_device(device))
    else:
        coll = SimulatedCollectives(ranks.world)
    cand = ParallelRuntime(ranks, device=device, dtype=compute, collectives=coll, resident=resident)
    if decode and mla_cache != "expanded" and cand.text.attention != "mla":
        raise ConfigError(
            f"--mla-cache {mla_cache}: '{cand.arch.name}' has no MLA attention (its cache is "
            f"per-head K/V); drop --mla-cache."
        )

    # -- inputs ------------------------------------------------------------------------
    avoid = set()
    if cand.vision is not None:
        avoid = {cand.vision.image_token_id}
        if cand.vision.video_token_id is not None:
            avoid.add(int(cand.vision.video_token_id))
    pv = grid = None
    if pixel_values is not None:
        from ..runtime.forward_cmd import load_safetensors, need_tensor

        d = load_safetensors(pixel_values, "--pixel-values")
        pv = need_tensor(d, "pixel_values", pixel_values, "--pixel-values")
        grid = need_tensor(d, "image_grid_thw", pixel_values, "--pixel-values").long()
        if cand.vision is None:
            raise ConfigError(
                f"--pixel-values {pixel_values}: '{cand.arch.name}' has no vision tower; only "
                f"kimi_k25 takes images."
            )
    if data is not None:
        tok_dir = ref_path if (ref_path / "tokenizer_config.json").exists() else cand_path
        ids, mask, is_text = vin.load_data(
            data, seq_len=seq_len, vocab=cand.vocab, tokenizer_dir=tok_dir
        )
        input_kind = {"kind": "data", "file": str(data)}
    else:
        ids = vin.random_ids(cand.vocab, random, seq_len, seed, avoid=avoid)
        mask, is_text = None, False
        input_kind = {"kind": "random", "seed": seed}
        if pv is not None:
            ids = _place_images(ids, grid, cand.vision.image_token_id, cand.vision)
    if mask is not None and bool(mask.all()):
        mask = None
    input_kind.update(batch=int(ids.shape[0]), seq_len=int(ids.shape[1]),
                      images=0 if grid is None else int(grid.shape[0]))  # fmt: skip
    from ..runtime.runtime import check_vocab

    check_vocab(ids.masked_fill(_special(ids, avoid), 0) if avoid else ids, cand.vocab)
    if cand.vision is not None:  # up front: under torchrun only stage 0 would notice
        n_img = int((ids == cand.vision.image_token_id).sum())
        merged = (
            0
            if grid is None
            else int(grid.prod(-1).sum()) // (cand.vision.merge[0] * cand.vision.merge[1])
        )
        if n_img != merged:
            raise ConfigError(
                f"the inputs hold {n_img} image token(s) (id {cand.vision.image_token_id}) but "
                f"the images give {merged} merged patches; the prompt and the images do not "
                f"match."
            )

    # -- the forward, in lockstep with the reference ----------------------------------
    bar = None
    if progress and me == 0:
        from tqdm import tqdm

        bar = tqdm(total=cand.num_layers, desc="verify: layers", unit="layer", file=sys.stderr,
                   leave=False)  # fmt: skip
    pos = cand.default_positions(ids)
    ref_rt = None
    hcand: list = []
    t0 = time.perf_counter()
    # every process passes a callback: forward then hands each layer's hidden state to
    # rank 0 (a collective under torchrun), where the reference compares it
    # rank 0 alone opens the reference; every process learns whether that worked, so a
    # bad reference stops all of them with its one error line instead of a hang
    err: Exception | None = None
    try:
        if me == 0 and ref_kind == "runtime":
            ref_rt = Runtime(
                open_checkpoint(ref_path), device=device, dtype=compute, act_quant=None
            )
            lock = _Lockstep(ref_rt, ids, mask, pv, grid, pos, bar)
        else:
            if me == 0:
                _need_transformers()
            lock = _Collect(hcand if me == 0 else None, bar)
    except K3Error as e:
        err = e
    failed = coll.flags(err is not None)
    if err is not None:
        raise err
    if any(failed):
        raise ConfigError(
            f"torchrun process {failed.index(True)} could not open the reference {ref_path} "
            f"(its error is printed above); nothing was run."
        )
    nonfinite = None
    try:
        try:
            logits = cand.forward(
                ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                position_ids=pos, on_layer=lock,
            )  # fmt: skip
        except NonFiniteError as e:  # agreed by every process: a failed candidate, exit 1
            nonfinite, logits = str(e), None
        t_fwd = time.perf_counter() - t0
        report: dict = {"rank": me}
        base = dict(
            candidate=str(cand_path), candidate_kind=cand_kind, reference=str(ref_path),
            reference_kind=ref_kind, reference_note=ref_note, layout=ranks.layout.to_json(),
            experts=_expert_summary(ranks), execution=coll.describe(), dtype=dtype,
            device=str(cand.device), inputs=input_kind, thresholds=asdict(th),
            act_quant=_act_note(cand),
        )  # fmt: skip
        if me == 0 and nonfinite is not None:
            layers = list(lock.layers) if isinstance(lock, _Lockstep) else []
            report.update(base, logits=None, layers=layers)
        elif me == 0:
            if ref_rt is not None:
                ref_logits = lock.logits()
                layers = lock.layers
                ref_rt.loader.release()
            else:
                ref_logits, hs = _transformers_reference(ref_path, ids, mask, pv, grid)
                layers = []
                for i, (a, b) in enumerate(zip(hs, hcand, strict=False)):
                    err = vm.rel_l2(a.float(), b.float())
                    layers.append({"layer": i, "rel_l2": _finite_or_none(err)})
            targets = (
                vin.next_token_targets(ids, mask if mask is not None else torch.ones_like(ids))
                if is_text
                else None
            )
            metrics = vm.compare_logits(ref_logits, logits, mask=mask, targets=targets)
            # bit-level fingerprint: a simulated and a torchrun run must print the same
            metrics["candidate_sha256"] = hashlib.sha256(
                logits.detach().cpu().contiguous().numpy().tobytes()
            ).hexdigest()
            report.update(base, logits=metrics, layers=layers)
        t_ref = time.perf_counter() - t0 - t_fwd
    finally:
        if bar is not None:
            bar.close()
        if ref_rt is not None:
            ref_rt.close()

    # -- decode check --------------------------------------------------------------------
    t1 = time.perf_counter()
    if decode and nonfinite is None:
        dec = _decode_check(cand, ids, mask, pv, grid, decode, kv_cache, mla_cache, avoid)
        if me == 0:
            report["decode"] = dec
    t_dec = time.perf_counter() - t1
    cand.close()
    rss_all = [_peak_rss_mib()]
    if dist_run:
        world = tuple(range(ranks.world))
        got = coll.all_gather({me: torch.tensor([rss_all[0]], dtype=torch.float64)}, world)
        rss_all = [float(t[0]) for t in got]
        # leave the process group cleanly: gloo's threads abort a process that exits
        # while they are still up
        dist.barrier()
        dist.destroy_process_group()
    if me != 0:
        return report
    rss = max(rss_all)
    report["time_s"] = round(time.perf_counter() - t_start, 3)
    report["time_breakdown_s"] = {
        # the reference runs in lockstep inside the candidate's forward
        "candidate_with_lockstep_reference": round(t_fwd, 3),
        "reference_head_and_metrics": round(t_ref, 3),
        "decode": round(t_dec, 3),
    }
    report["peak_rss_mib"] = round(rss, 1)
    if dist_run:
        report["peak_rss_scope"] = "the largest of the torchrun processes"
        report["peak_rss_mib_per_rank"] = [round(x, 1) for x in rss_all]
    else:
        report["peak_rss_scope"] = "this process (all ranks simulated)"
    if nonfinite is not None:
        passed, why = False, f"the candidate's forward produced NaN / inf: {nonfinite}"
    else:
        passed, why = vm.check(report["logits"], th, report["layers"])
    dec = report.get("decode")
    if passed and dec is not None and not dec["passed"]:
        passed, why = False, dec["failure"]
    report["passed"] = passed
    report["failure"] = why
    report["fidelity"] = _fidelity_of(cand_path)
    if json_path is not None:
        from .report import write_json

        write_json(report, json_path)
    if plot_path is not None:
        from .report import plot

        plot(report, plot_path)
    return report


def _finite_or_none(x: float) -> float | None:
    """JSON has no inf: a layer whose error is unbounded is recorded as None."""
    return x if math.isfinite(x) else None


class _Collect:
    """on_layer for processes without the lockstep reference: keeps the hidden states
    (transformers reference, rank 0) or nothing, and ticks the progress bar."""

    def __init__(self, keep: list | None, bar):
        self.keep, self.bar = keep, bar

    def __call__(self, i: int, h: torch.Tensor | None) -> None:
        if self.keep is not None and h is not None:
            self.keep.append(h)
        if self.bar is not None:
            self.bar.update(1)


def _special(ids: torch.Tensor, avoid: set) -> torch.Tensor:
    m = torch.zeros_like(ids, dtype=torch.bool)
    for t in avoid:
        m |= ids == t
    return m


def _place_images(ids: torch.Tensor, grid: torch.Tensor, token: int, vs) -> torch.Tensor:
    """Random prompts with images: every image's merged patches as image tokens in row
    0, one image after another from position 1."""
    merge = vs.merge[0] * vs.merge[1]
    need = int(grid.prod(-1).sum()) // merge
    if 1 + need > ids.shape[1]:
        raise ConfigError(
            f"the images need {need} image tokens but --seq-len is {ids.shape[1]}; raise "
            f"--seq-len to at least {need + 1}."
        )
    ids = ids.clone()
    ids[0, 1 : 1 + need] = token
    return ids


def _expert_summary(ranks) -> dict | None:
    ex = ranks.experts
    if not ex:
        return None
    red = ex.get("redundant", 0)
    return {"policy": ex.get("policy"), "num_experts": ex.get("num_experts"), "redundant": red,
            "copy_rule": "token t uses copy t mod copies of its expert"}  # fmt: skip


def _act_note(cand: ParallelRuntime) -> str | None:
    kv = (
        "KV cache fake-quantized to FP8 e4m3 with the checkpoint's calibrated per-layer "
        "k_scale / v_scale (MLA: latent and roped key with k_scale)"
    )
    if not cand.act_specs or not cand.act_quant:
        return kv if cand.kv_quant else None
    note = "activation fake-quantization on"
    if cand.layout.tp > 1:
        note += (
            "; row-parallel Linears (o_proj, down_proj) quantize their local input slice, "
            "as serving engines do"
        )
    return f"{note}; {kv}" if cand.kv_quant else note


def _kv_cache_scales(cand: ParallelRuntime, mla_cache: str) -> dict | None:
    """``{layer: {kind: scale}}`` for :class:`KVCache` from the candidate's k_scale /
    v_scale (read from the first rank of the layer's stage; the scales are replicated):
    GQA layers cache K / V; MLA layers only in the latent layout (the expanded layout
    caches kv_b_proj's outputs, which no calibrated scale describes); KDA layers none.
    None when the candidate has no kv_cache_scheme or its quantization is off."""
    if not cand.kv_quant:
        return None
    out: dict[int, dict[str, float]] = {}
    for i in range(cand.num_layers):
        kind = cand.text.attention_of(i)
        if kind == "kda" or (kind == "mla" and mla_cache != "latent"):
            continue
        unit = f"layer.{i}"
        reader = cand.ranks.rank(cand.ranks.tp_group(cand._stage_of[unit])[0])
        entries = cand.plan.units[unit]

        def value(k: str, reader=reader, entries=entries) -> float:
            name = entries[f"attention.{k}_scale"].name
            return float(reader.get(name, torch.float32).reshape(-1)[0])

        k = value("k")
        out[i] = {"k": k, "v": value("v")} if kind == "gqa" else {"latent": k, "k_rot": k}
    return out or None


def _decode_check(cand, ids, mask, pv, grid, n, kv_cache, mla_cache, avoid) -> dict:
    """Greedy decode of ``n`` tokens with a KV cache, against full forwards. An FP8 cache
    of a candidate with calibrated KV-cache scales stores with those scales (what a
    serving engine loads), where they describe what the cache holds."""
    scales = _kv_cache_scales(cand, mla_cache) if kv_cache == "fp8" else None
    cache = KVCache(mla=mla_cache, kv_dtype=kv_cache, scales=scales)
    prompt_note = None
    if mask is not None:
        # right-padded rows would continue after their padding: decode from the longest
        # prefix every row really has (when that keeps the images' tokens)
        lens = mask.long().sum(-1)
        prefix = bool((mask.bool() == (torch.arange(mask.shape[1]) < lens[:, None])).all())
        cut = int(lens.min())
        keeps_images = not avoid or bool((_special(ids[:, cut:], avoid) == 0).all())
        if prefix and cut >= 1 and (pv is None or keeps_images):
            ids, mask = ids[:, :cut], None
            prompt_note = f"prompts cut to the {cut} tokens every row has (right padding)"
    b = ids.shape[0]
    ones = torch.ones(b, 1, dtype=torch.long, device=ids.device)
    full_mask = mask
    step_logits = [cand.forward(ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                                cache=cache)[:, -1:]]  # fmt: skip
    seq = ids
    special = sorted(avoid)
    for _ in range(n - 1):
        nxt = step_logits[-1][:, -1]
        if special:  # greedy, but never an image / video placeholder (it needs pixels)
            nxt = nxt.clone()
            nxt[:, special] = float("-inf")
        tok = nxt.argmax(-1, keepdim=True)
        seq = torch.cat((seq, tok.to(seq.device)), dim=1)
        if full_mask is not None:
            full_mask = torch.cat((full_mask, ones), dim=1)
        step_logits.append(cand.forward(tok, attention_mask=full_mask, cache=cache))
    inc = torch.cat(step_logits, dim=1)  # [B, n, V]
    full = cand.forward(seq, attention_mask=full_mask, pixel_values=pv, image_grid_thw=grid)
    full = full[:, ids.shape[1] - 1 :]
    err = float(((inc - full).abs().max() / full.abs().max().clamp_min(1e-30)).item())
    same = bool((inc.argmax(-1) == full.argmax(-1)).all())
    out = {"steps": n, "kv_cache": cache.describe(cand.text.attention), "max_rel_err": err,
           "argmax_equal": same,
           # every rank's cache when simulated; this process's ranks under torchrun
           "cache_mib_this_process": round(cache.nbytes() / 2**20, 3)}  # fmt: skip
    if scales:
        out["kv_scales"] = f"calibrated, from the candidate ({len(scales)} layers)"
    if prompt_note:
        out["prompt"] = prompt_note
    # activation specs that run (routed experts' only with act_quant_experts)
    specs = {
        n: sp for n, sp in cand.act_specs.items()
        if cand.act_quant and (cand.act_quant_experts or n not in cand._routed)
    }  # fmt: skip
    dynamic = any(sp.dynamic for sp in specs.values())
    latent_kvb = mla_cache == "latent" and any("kv_b_proj" in n for n in specs)
    if kv_cache == "fp8" or dynamic or latent_kvb:
        # not bit-for-bit: an e4m3 cache rounds K / V; dynamic activation scales depend
        # on the chunk a Linear sees (MLA's kv_b_proj takes one scale per sequence, as
        # transformers feeds it), so a one-token step quantizes differently; the latent
        # cache absorbs kv_b_proj as a weight, without its input quantization
        why = (
            "an FP8 KV cache" if kv_cache == "fp8"
            else "dynamic activation quantization" if dynamic
            else "the latent MLA cache (kv_b_proj's input quantization is absorbed away)"
        )  # fmt: skip
        kld = vm.compare_logits(full, inc)["kld"]
        out["kld_vs_full"] = kld["mean"]
        out["kld_vs_full_max"] = kld["max"]
        out["compared_by"] = f"mean KLD (not bit-exact with {why})"
        ok = bool(kld["mean"] is not None and kld["mean"] <= FP8_KV_MAX_KLD)
        out["passed"] = ok
        out["failure"] = None if ok else (
            f"decode with {why}: mean KLD {kld['mean']:.3g} vs the full forward exceeds "
            f"{FP8_KV_MAX_KLD}"
        )  # fmt: skip
    else:
        limit = 1e-5 if cand.dtype == torch.float32 else 2e-2
        ok = same and err <= limit
        out["passed"] = ok
        out["failure"] = None if ok else (
            f"incremental decode differs from the full forward: max rel err {err:.3g} "
            f"(limit {limit:g}), argmax {'equal' if same else 'differs'}"
        )  # fmt: skip
    return out


__all__ = ["parse_layout", "run_verify"]
