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
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..arch import resolve
from ..checkpoint import load_json, open_checkpoint
from ..checkpoint.bounded import read_json
from ..device import resolve_device
from ..errors import CheckpointError, ConfigError, K3Error, NonFiniteError
from ..layout import Layout
from ..parallel import (
    SimulatedCollectives,
    TorchDistributedCollectives,
    init_distributed,
    under_torchrun,
)
from ..parallel.collectives import process_flags
from ..quant import fidelity
from ..runtime.cache import KVCache
from ..runtime.forward_cmd import load_safetensors, need_tensor
from ..runtime.parallel import ParallelRuntime
from ..runtime.ranks import planned_ranks, stream_ranks
from ..runtime.runtime import Runtime, check_vocab, parse_dtype
from ..stream import open_stream
from ..stream.check import check as check_stream_dir
from ..stream.format import StreamCorruptError
from . import inputs as vin
from . import metrics as vm
from .decode import decode_check, special_tokens
from .report import plot, write_json
from .summary import build_summary, reference_info


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
    from ..stream.format import is_stream_dir

    return is_stream_dir(p)


def _already_open(ck, ref_kind: str, ref_path: Path) -> dict:
    """The reference checkpoint, opened once for the report and the run: ``ck`` when it
    is a Checkpoint of ``ref_path`` (the caller's, already open), else none yet."""
    if ck is not None and ref_kind == "runtime" and Path(ck.root).resolve() == ref_path.resolve():
        return {ref_path: ck}
    return {}


def _open_candidate(
    path: Path, layout: Layout | None, check_stream: bool, placement: dict, only_rank=None
):
    """(RankSet, kind, source path of provenance or None)."""
    if _is_stream(path) or (path.is_dir() and (path / "journal").is_dir()):
        if layout is not None or any(placement.values()):
            raise ConfigError(
                f"{path}: a stream directory carries its own layout and expert placement; "
                f"drop --layout / --pp-layers / --expert-load / --redundant-experts (they are "
                f"for a checkpoint cut on the fly)."
            )
        if check_stream:
            rep = check_stream_dir(path, ranks=None if only_rank is None else {only_rank})
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
        # a reference with another quantization: its own encodings, carried over, set no
        # family; the same one at tp > 1 with dynamic activations is judged by its scheme
        th = vm.thresholds_for_quant_config(cand_cfg, ref_cfg if qc != rq else None)
        if th.kind == "exact":
            th = LOW_PRECISION_EXACT.get(compute) or th
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
    f = cand / fidelity.FILE
    if not f.is_file():
        return None
    try:
        rep = fidelity.LossReport.from_json(read_json(f, "report", ConfigError))
    except (ConfigError, ValueError, TypeError, KeyError, AttributeError) as e:
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
    reference_checkpoint=None,
) -> dict:
    """Run the check; returns the report (``report["passed"]``). Under torchrun only rank
    0's report is complete (``report["rank"]`` says which). pp_layers / expert_load /
    redundant_experts: the placement for a checkpoint cut on the fly, as ``shard`` takes
    them. resident: keep the candidate's weights in memory (fast decoding of small
    models); default streams them, layer by layer, on every forward and decode step.
    distributed: False runs every rank in this process even under torchrun (convert's
    process 0, after the others wrote their units); None: torchrun decides.
    reference_checkpoint: an open checkpoint (convert's source), used if it is the reference."""
    t_start = time.perf_counter()
    cand_path, lay, compute = _checked_args(candidate, layout, seq_len, decode, random, dtype,
                                            json_path, plot_path, kv_cache, mla_cache)  # fmt: skip
    dist_run = under_torchrun() if distributed is None else distributed
    if dist_run:
        init_distributed(resolve_device(device))
    me = dist.get_rank() if dist_run else 0
    placement = dict(pp_layers=pp_layers, expert_load=expert_load,
                     redundant_experts=redundant_experts)  # fmt: skip
    vsrc = _open_engine(cand_path, lay, placement, dist_run, check_stream)
    if vsrc is None:
        ranks, cand_kind, prov = _open_ranks(cand_path, lay, check_stream, placement, dist_run,
                                             me)  # fmt: skip
    else:  # vLLM's rank files, mapped back: run unsharded (vLLM runs its own layout)
        ranks, cand_kind, prov = _Unsharded(vsrc.config), "vllm-sharded-state", vsrc.source
    ref_kind, ref_path, ref_note = _resolve_reference(reference, prov, cand_path)
    _refuse_self_compare(cand_kind, ranks, ref_kind, ref_path, cand_path, decode)
    ref_cfg = load_json(ref_path / "config.json")
    _check_same_model(ranks.config, ref_cfg, str(cand_path), str(ref_path))
    th = _thresholds(ranks.config, ref_cfg, ranks.layout, compute, max_kld, min_top1, max_rel_err)

    if dist_run:
        groups = [ranks.tp_group(s.pp_rank) for s in ranks.stages]
        coll = TorchDistributedCollectives(ranks.world, groups, resolve_device(device))
    else:
        coll = SimulatedCollectives(ranks.world)
    cand = (Runtime(vsrc, device=device, dtype=compute, resident=resident) if vsrc else
            ParallelRuntime(ranks, device=device, dtype=compute, collectives=coll,
                            resident=resident))  # fmt: skip
    if decode and mla_cache != "expanded" and cand.text.attention != "mla":
        raise ConfigError(
            f"--mla-cache {mla_cache}: '{cand.arch.name}' has no MLA attention (its cache is "
            f"per-head K/V); drop --mla-cache."
        )
    inp = _inputs(cand, data, ref_path, cand_path, seq_len, random, seed, pixel_values)
    opened = _already_open(reference_checkpoint, ref_kind, ref_path)
    base = dict(
        candidate=str(cand_path), candidate_kind=cand_kind, reference=str(ref_path),
        reference_kind=ref_kind, reference_note=ref_note,
        reference_info=(_reference_info(ref_kind, ref_path, reference, prov, cand_path, dtype,
                                        opened) if me == 0 else None),
        layout=ranks.layout.to_json(),
        experts=_expert_summary(ranks), execution=coll.describe(), dtype=dtype,
        device=str(cand.device), inputs=inp.kind, thresholds=asdict(th),
        act_quant=_act_note(cand),
    )  # fmt: skip
    if vsrc is not None:
        base.update(vllm_layout=vsrc.layout, candidate_note=vsrc.describe())
    report, nonfinite, t_fwd, t_ref = _lockstep_forward(
        cand, coll, inp, me, ref_kind, ref_path, device, compute, progress, base,
        opened.pop(ref_path, None),
    )  # fmt: skip
    t1 = time.perf_counter()
    if decode and nonfinite is None:
        dec = decode_check(cand, inp.ids, inp.mask, inp.pv, inp.grid, decode, kv_cache,
                           mla_cache, inp.avoid)  # fmt: skip
        if me == 0:
            report["decode"] = dec
    t_dec = time.perf_counter() - t1
    cand.close()
    rss_all = [_peak_rss_mib()]
    if dist_run:
        world = tuple(range(ranks.world))
        got = coll.all_gather({me: torch.tensor([rss_all[0]], dtype=torch.float64)}, world)
        rss_all = [float(t[0]) for t in got]
        # leave the group cleanly: gloo's threads abort a process exiting while they run
        dist.barrier()
        dist.destroy_process_group()
    if me != 0:
        return report
    report["time_s"] = round(time.perf_counter() - t_start, 3)
    report["time_breakdown_s"] = {
        # the reference runs in lockstep inside the candidate's forward
        "candidate_with_lockstep_reference": round(t_fwd, 3),
        "reference_head_and_metrics": round(t_ref, 3),
        "decode": round(t_dec, 3),
    }
    _verdict(report, th, nonfinite, rss_all, dist_run, cand_path)
    if json_path is not None:
        write_json(report, json_path)
    if plot_path is not None:
        plot(report, plot_path)
    return report


def _checked_args(candidate, layout, seq_len, decode, random, dtype, json_path, plot_path,
                  kv_cache, mla_cache):  # fmt: skip
    """(candidate path, layout, compute dtype): every argument checked before any work."""
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
            import matplotlib  # noqa: F401  (optional: only --plot needs it)
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib).") from None
    if decode:
        KVCache(mla=mla_cache, kv_dtype=kv_cache)  # bad values fail here, before any work
    elif kv_cache is not None or mla_cache != "expanded":
        raise ConfigError(
            "--kv-cache / --mla-cache choose the decode check's cache; add --decode N."
        )
    return cand_path, lay, compute


def _refuse_self_compare(cand_kind, ranks, ref_kind, ref_path: Path, cand_path: Path,
                         decode: int) -> None:  # fmt: skip
    if (
        cand_kind == "checkpoint"
        and ranks.layout.world == 1
        and ref_kind == "runtime"
        and ref_path.resolve() == cand_path.resolve()
        and not decode  # --decode checks the cached decode against the model's own forward
    ):
        raise ConfigError(
            f"{cand_path}: verify would compare this checkpoint with itself (one rank, the "
            f"same weights, the same runtime), so there is nothing to check. Verify what "
            f"`shard` or `convert` wrote, add --layout tp=2 (or pp=2) to check a parallel "
            f"layout of it, --decode N to check incremental decoding, or compare with "
            f"another model: --reference ORIGINAL or --reference transformers."
        )


class _Unsharded:
    """What verify needs of a candidate run by the plain runtime (one rank, no experts)."""

    def __init__(self, config: dict):
        self.config, self.layout, self.experts, self.world = config, Layout(), None, 1


def _open_engine(path: Path, lay, placement: dict, dist_run: bool, check: bool):
    """An engine target's written directory (vLLM's sharded_state) as a weight source, from
    the target registry (None: not one)."""
    from .. import targets

    t = targets.written_by(path)
    if t is None or t.source_fn is None:
        return None
    if lay is not None or any(placement.values()) or dist_run:
        raise ConfigError(
            f"{path}: a {t.name} output is verified by mapping its rank files back and "
            f"running the model in one process; drop --layout / --pp-layers / "
            f"--expert-load / --redundant-experts and torchrun."
        )
    return t.source(path, check)


def _open_ranks(cand_path: Path, lay, check_stream: bool, placement: dict, dist_run: bool,
                me: int):  # fmt: skip
    """(ranks, candidate kind, provenance); under torchrun each process opens and checks
    its own rank, and every process fails when one did."""
    err = None
    ranks = cand_kind = prov = None
    try:
        only = me if dist_run else None
        ranks, cand_kind, prov = _open_candidate(cand_path, lay, check_stream, placement, only)
    except K3Error as e:
        err = e
    if dist_run:  # each process checked its own rank's units: agree on the verdict
        failed = process_flags(err is not None)
        if err is None and any(failed):
            err = StreamCorruptError(
                f"{cand_path}: torchrun process {failed.index(True)} could not open or "
                f"check its part of the candidate (its error is printed above); nothing "
                f"was run."
            )
    if err is not None:
        raise err
    return ranks, cand_kind, prov


@dataclass
class _Inputs:
    """The sequences verify runs: ids, their mask (None: no padding), whether they are
    text (next-token targets), images (pixel values and grid), the ids a random input
    avoids (the vision placeholders) and the report's description."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    is_text: bool
    pv: torch.Tensor | None
    grid: torch.Tensor | None
    avoid: set
    kind: dict


def _inputs(cand, data, ref_path: Path, cand_path: Path, seq_len: int, random: int, seed: int,
            pixel_values) -> _Inputs:  # fmt: skip
    avoid = set()
    if cand.vision is not None:
        avoid = {cand.vision.image_token_id}
        if cand.vision.video_token_id is not None:
            avoid.add(int(cand.vision.video_token_id))
    pv = grid = None
    if pixel_values is not None:
        d = load_safetensors(pixel_values, "--pixel-values")
        pv = need_tensor(d, "pixel_values", pixel_values, "--pixel-values")
        grid = need_tensor(d, "image_grid_thw", pixel_values, "--pixel-values").long()
        if cand.vision is None:
            raise ConfigError(
                f"--pixel-values {pixel_values}: '{cand.arch.name}' has no vision tower; only "
                f"a multimodal family (kimi_k25, kimi_k3) takes images."
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
    check_vocab(ids.masked_fill(special_tokens(ids, avoid), 0) if avoid else ids, cand.vocab)
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
    return _Inputs(ids, mask, is_text, pv, grid, avoid, input_kind)


def _lockstep_forward(cand, coll, inp: _Inputs, me: int, ref_kind: str, ref_path: Path,
                      device, compute, progress: bool, base: dict, ref_ck=None):  # fmt: skip
    """The candidate's forward with the reference in lockstep (rank 0 compares each
    layer's hidden state), then the logits' metrics: (report, the non-finite error or
    None, forward seconds, reference head and metrics seconds). ``ref_ck``: the reference
    checkpoint if it is open already."""
    ids, mask, pv, grid = inp.ids, inp.mask, inp.pv, inp.grid
    bar = None
    if progress and me == 0:
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
            ck = ref_ck if ref_ck is not None else open_checkpoint(ref_path)
            ref_rt = Runtime(ck, device=device, dtype=compute, act_quant=None)
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
                if inp.is_text
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
    return report, nonfinite, t_fwd, t_ref


def _verdict(report: dict, th, nonfinite, rss_all: list, dist_run: bool, cand_path) -> None:
    """Peak memory, pass / fail (the logits and layers against the thresholds, then the
    decode check) and the candidate's release fidelity, into ``report``."""
    report["peak_rss_mib"] = round(max(rss_all), 1)
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
    report["summary"] = build_summary(report)


def _reference_info(ref_kind: str, ref_path: Path, reference, prov, cand_path: Path,
                    dtype: str, opened: dict | None = None) -> dict:  # fmt: skip
    """What the candidate is compared with (:func:`summary.reference_info`), the original
    followed through a quantized checkpoint's provenance."""
    orig, moved = None, None
    if prov is not None and (Path(prov) / "config.json").is_file():
        orig, moved = _original(Path(prov))
    return reference_info(ref_kind, ref_path, orig, moved, cand_path, dtype, opened)


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
    if getattr(cand, "layout", Layout()).tp > 1:
        note += (
            "; row-parallel Linears (o_proj, down_proj) quantize their local input slice, "
            "as serving engines do"
        )
    return f"{note}; {kv}" if cand.kv_quant else note


__all__ = ["parse_layout", "run_verify"]
