"""The recipe schema: one frozen dataclass per section (what a recipe may say, with its
defaults), as :mod:`.parse` builds them from YAML."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..calibrate.options import SequentialOptions
from ..errors import ConfigError
from ..layout import Layout


@dataclass(frozen=True)
class RuleSpec:
    """One quantization rule: tensors matching ``match`` AND ``roles`` get ``scheme``.

    match: glob(s) or ``re:`` regex(es) on tensor / module names (empty: any);
    roles: component / alias / kind names (empty: any); scheme: registered name or
    ``keep``; options: scheme overrides (group_size, symmetric, block, scale_fmt,
    scale_dtype, num_bits, strategy).
    """

    scheme: str
    match: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CalibrateSection(SequentialOptions):
    """``quantize --calibrate``'s options: every field of
    :class:`k3convert.calibrate.options.SequentialOptions`, plus the algorithm."""

    algorithm: str = "gptq"

    def options(self) -> SequentialOptions:
        return SequentialOptions(
            **{f.name: getattr(self, f.name) for f in fields(SequentialOptions)}
        )


@dataclass(frozen=True)
class AutoKeepSection:
    """``quantize --auto-keep``: budget, ladder scheme, sensitivity method, chart path."""

    budget: str
    scheme: str | None = None
    sensitivity: str = "layer"
    plot: str | None = None


@dataclass(frozen=True)
class QuantizeSection:
    scheme: str | None = None
    rules: tuple[RuleSpec, ...] = ()
    keep: tuple[str, ...] = ()
    default_keep: bool = True
    calibrate: CalibrateSection | None = None
    auto_keep: AutoKeepSection | None = None


@dataclass(frozen=True)
class SourceSection:
    """What the recipe converts. ``path``: the checkpoint directory (the command line's
    SRC wins); ``model_type``: the config.json ``model_type`` the recipe was written for
    (a different model is refused before any work)."""

    path: str | None = None
    model_type: str | None = None


@dataclass(frozen=True)
class LayoutSection:
    """The parallel layout of the stream (``shard``'s options). ``moe_tp`` defaults to
    ``tp // moe_ep``; ``pp_layers``: layers per pipeline stage (default: balanced by
    bytes); ``expert_load``: a routing-counts JSON file, or ``calibration`` for the counts
    this conversion's calibration measures, to balance experts over EP ranks;
    ``redundant_experts``: extra replicas of the hottest experts per layer."""

    tp: int = 1
    pp: int = 1
    moe_tp: int | None = None
    moe_ep: int = 1
    pp_layers: tuple[int, ...] = ()
    expert_load: str | None = None
    redundant_experts: int = 0

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, moe_tp=self.moe_tp, moe_ep=self.moe_ep)


@dataclass(frozen=True)
class OutputSection:
    """How units are written: ``compression`` (none / zstd), ``workers`` (units and
    tensors in flight; default: the CPUs), ``unit_hash`` (xxh3-128 / sha256). Where they
    will be served: ``serving_device`` (vLLM on cuda / cpu; ``auto``: this machine's for
    ``format: vllm``, else cuda: :func:`k3convert.serving.resolve_device`) is checked at
    the layout's tp (:mod:`k3convert.serving`: a warning per tensor it would refuse;
    ``strict_serving``: an error before any work). ``format``: ``stream`` or ``vllm``."""

    compression: str = "none"
    workers: int | None = None
    unit_hash: str = "xxh3-128"
    serving_device: str = "auto"
    strict_serving: bool = False
    #: stream (k3convert's per-rank stream) or vllm (vLLM's sharded_state files, as
    #: ``shard --target vllm`` writes them)
    format: str = "stream"


@dataclass(frozen=True)
class VerifySection:
    """``verify`` after ``convert``: the candidate stream against ``reference`` (default:
    the source; ``transformers`` for transformers' own model). Inputs: ``data`` (a token
    file) or ``samples`` random sequences of ``seq_len`` tokens, ``pixel_values`` for an
    image; ``decode`` incremental-decode steps; thresholds (None: the per-scheme
    defaults); ``enabled: false`` skips it."""

    enabled: bool = True
    reference: str | None = None
    data: str | None = None
    samples: int = 2
    seq_len: int = 32
    decode: int = 4
    pixel_values: str | None = None
    kv_cache: str | None = None
    max_kld: float | None = None
    min_top1: float | None = None
    max_rel_err: float | None = None
    dtype: str = "fp32"


@dataclass(frozen=True)
class TargetSection:
    """The hardware a recipe is written for: ``device`` (a name ``plan --device`` knows:
    h100, h200, b200, ...; the layout's tp x pp of them) and the workload it assumes,
    ``context`` tokens per sequence x ``batch`` sequences. ``plan --recipe`` takes them as
    its defaults; ``recipe list`` shows them."""

    device: str
    context: int = 131072
    batch: int = 1

    def describe(self, layout: LayoutSection) -> str:
        """``16 x h200, 128K tokens x 4``."""
        n = layout.tp * layout.pp
        ctx = f"{self.context // 1024}K" if self.context % 1024 == 0 else str(self.context)
        return f"{n} x {self.device}, {ctx} tokens x {self.batch}"


#: the recipe schema versions this release reads
VERSIONS = (1,)


@dataclass(frozen=True)
class Recipe:
    version: int = 1
    description: str = ""
    source: SourceSection = field(default_factory=SourceSection)
    quantize: QuantizeSection | None = None
    layout: LayoutSection = field(default_factory=LayoutSection)
    output: OutputSection = field(default_factory=OutputSection)
    verify: VerifySection = field(default_factory=VerifySection)
    target: TargetSection | None = None
    #: where the recipe came from (a file path, a preset, ``<recipe>``); not part of it
    origin: str = field(default="<recipe>", compare=False)

    def require_quantize(self) -> QuantizeSection:
        """The quantize section, for the commands that need one."""
        if self.quantize is None:
            raise ConfigError(
                f"{self.origin}: the recipe has no quantize section, so it keeps every tensor "
                f"as released; `k3convert quantize` needs quantize.rules or quantize.scheme "
                f"(`k3convert convert` runs such a recipe: shard + verify)."
            )
        return self.quantize


#: ``layout.expert_load`` value: the routing counts this conversion's calibration measures
CALIBRATION = "calibration"
