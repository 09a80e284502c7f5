"""A plan's result and its renderings: the table, the JSON document, the chart."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..inspect import render_table
from ..layout import Layout
from ..units import human_bytes
from .workload import ACT_BYTES, Workload

FORMAT = "k3convert-plan-v1"


COMPONENTS = ("weights", "kv_cache", "kda_state", "activations")


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
    return render_table(headers, rows)


def plot_plan(plan: MemoryPlan, path: str | Path) -> Path:
    """A PNG of :func:`plan_figure`."""
    out = Path(path)
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {out}: the directory {out.parent} does not exist.")
    fig = plan_figure(plan)
    try:
        fig.savefig(out, format="png", dpi=100)
    except OSError as e:
        raise ConfigError(f"--plot {out}: cannot write ({e.strerror or e}).") from e
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def plan_figure(plan: MemoryPlan):
    """Per-rank memory stacked by component, the budget as a line, the part of a rank
    over it hatched in red, the device in the title. Needs matplotlib (a dependency, imported
    only for a plot): a ConfigError says so when an install lacks it. The caller closes it
    (pyplot)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed (a dependency of k3convert: "
            "reinstall it, or `pip install matplotlib`), or leave --plot out."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        if any(free):  # (a legend entry only for what is drawn)
            ax.bar(ranks, free, bottom=bottom, color=colors["free"], label=labels["free"])
        over = [(r.rank, (r.total - plan.budget) / gib) for r in plan.ranks
                if r.total > plan.budget]  # fmt: skip
        if over:  # the part of each bar above the budget, hatched and outlined
            ax.bar([x for x, _ in over], [h for _, h in over], bottom=plan.budget / gib,
                   fill=False, edgecolor="red", hatch="//", linewidth=1,
                   label=f"over budget ({len(over)} rank(s))")  # fmt: skip
        ax.axhline(
            plan.budget / gib,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"budget {plan.budget / gib:.1f} {unit}",
        )
    lay = plan.layout
    on = f"; device {plan.device}" if plan.device else ""
    ax.set_title(
        f"{plan.model['model_type']}: tp {lay.tp} x pp {lay.pp}, ep {lay.moe_ep}{on}; "
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
    return fig
