"""The report's figures (matplotlib, Agg): survival curves with bootstrap bands, hazard by
step, decomposition bars, the sharp interval, branch-aligned TV by lag, early vs late.

:data:`FIGURES` is the one registry of figures: each entry carries its drawing function, its
title and its caption (the report's figure section reads them from here).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcouple.analysis.quantities import label
from kvcouple.textsafe import terminal

if TYPE_CHECKING:
    from kvcouple.analysis.results import AnalysisResult

Rows = list[dict[str, Any]]


def _get(rows: Rows, **match: Any) -> Rows:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _series(tables: dict[str, Rows]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for r in tables["summary"]:
        key = (r["model"], r["policy"])
        if key not in seen:
            seen.append(key)
    return seen


def _horizons(tables: dict[str, Rows]) -> dict[str, int]:
    """T per model, from the survival curve's last step."""
    out: dict[str, int] = {}
    for r in tables["curves"]:
        if r["curve"] == "survival":
            out[r["model"]] = max(out.get(r["model"], 0), int(r["x"]))
    return out


def _text(s: Any) -> str:
    """A model or policy name as plot text: control characters escaped, no mathtext."""
    return terminal(s).replace("$", r"\$")


def _label(tables: dict[str, Rows], model: str, pol: str) -> str:
    """The policy's short label (full specs are in the report's legend), with the model's
    name when several models are plotted together."""
    from kvcouple.analysis.labels import short_label

    several = len({m for m, _ in _series(tables)}) > 1
    return _text(f"{model} {short_label(pol)}" if several else short_label(pol))


def _curve_plot(ax: Any, tables: dict[str, Rows], curve: str) -> None:
    """Each series' curve with its pointwise band (inside the curve's range: every interval
    is made on its scale); a point without a band (too few documents inform it) is drawn as
    an open marker, never as a band outside the range. The axis spans the registry's range."""
    import math

    from kvcouple.analysis.quantities import quantity

    bare = False
    for model, pol in _series(tables):
        rows = sorted(
            _get(tables["curves"], model=model, policy=pol, curve=curve), key=lambda r: r["x"]
        )
        x = [r["x"] for r in rows]
        line = ax.plot(
            x, [r["estimate"] for r in rows], marker=".", label=_label(tables, model, pol)
        )
        banded = [math.isfinite(r["ci_low"]) and math.isfinite(r["ci_high"]) for r in rows]
        ax.fill_between(
            x,
            [r["ci_low"] if b else r["estimate"] for r, b in zip(rows, banded, strict=True)],
            [r["ci_high"] if b else r["estimate"] for r, b in zip(rows, banded, strict=True)],
            where=banded,
            alpha=0.2,
            color=line[0].get_color(),
        )
        lone = [
            r for r, b in zip(rows, banded, strict=True) if not b and r["estimate"] == r["estimate"]
        ]
        if lone:
            bare = True
            ax.plot(
                [r["x"] for r in lone], [r["estimate"] for r in lone], linestyle="none",
                marker="o", mfc="none", color=line[0].get_color(),
            )  # fmt: skip
    if bare:
        ax.plot([], [], linestyle="none", marker="o", mfc="none", color="0.3",
                label="no band: too few documents")  # fmt: skip
    low, high = quantity(curve).value_range(max(_horizons(tables).values(), default=1))
    pad = 0.02 * (high - low)
    ax.set_ylim(low - pad, high + pad)
    ax.legend(fontsize=7)


def _subplots(figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A figure and its axes without pyplot: no global backend switch and nothing to close,
    so notebooks that write reports keep their inline plots."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def make_figures(tables: dict[str, Rows], folder: Path, stamp: str = "") -> dict[str, bytes]:
    """Draw every figure, save it as PNG in ``folder`` and return the PNG bytes by name.
    ``stamp`` (the plan hash and settings) is printed in a corner of every figure."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, bytes] = {}
    for name, fig in draw_figures(tables).items():
        buf = io.BytesIO()
        if stamp:
            fig.text(0.995, 0.005, stamp, ha="right", va="bottom", fontsize=7, color="0.4")
        fig.savefig(buf, format="png", dpi=110)
        out[name] = buf.getvalue()
        (folder / f"{name}.png").write_bytes(out[name])
    return out


def _legend_outside(ax: Any) -> None:
    """The legend right of the axes, where it cannot cover a bar or an error bar."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def draw_figures(tables: dict[str, Rows]) -> dict[str, Any]:
    """Every figure of the report as a matplotlib ``Figure`` (laid out, not saved), by name:
    survival, hazard, branch_tv_by_lag, decomposition, sharp_interval, early_vs_late."""
    figures: dict[str, Any] = {}
    for name, figure in FIGURES.items():
        fig = figure.draw(tables)
        fig.tight_layout()
        figures[name] = fig
    return figures


def _summary_row(tables: dict[str, Rows], model: str, pol: str, name: str) -> dict[str, Any]:
    """The summary row of one quantity (NaN values when it is missing)."""
    rows = _get(tables["summary"], model=model, policy=pol, quantity=name)
    nan = float("nan")
    return rows[0] if rows else {"estimate": nan, "ci_low": nan, "ci_high": nan}


def _tick_labels(tables: dict[str, Rows]) -> list[str]:
    # Policy specs are long ("snapkv:retain=0.5,window=32,..."): one parameter per line.
    return [
        _label(tables, m, p).replace(",", "\n").replace(" ", "\n", 1) for m, p in _series(tables)
    ]


def _bar_width(tables: dict[str, Rows], extra: float = 0.0) -> tuple[float, float]:
    return (max(4, 1.3 * len(_series(tables)) + 2) + extra, 4)


def survival_figure(tables: dict[str, Rows]) -> Any:
    fig, ax = _subplots(figsize=(6, 4))
    _curve_plot(ax, tables, "survival")
    ax.set(
        xlabel="step t",
        ylabel=label("survival"),
        title="Survival (no divergence yet)",
    )
    return fig


def hazard_figure(tables: dict[str, Rows]) -> Any:
    fig, ax = _subplots(figsize=(6, 4))
    _curve_plot(ax, tables, "hazard")
    ax.set(xlabel="step t", ylabel=label("hazard"), title="Hazard by step")
    return fig


def branch_tv_figure(tables: dict[str, Rows]) -> Any:
    fig, ax = _subplots(figsize=(6, 4))
    _curve_plot(ax, tables, "branch_tv")
    ax.set(
        xlabel="lag after divergence",
        ylabel=label("branch_tv") + " (see caption)",
        title="Branch-aligned TV by lag",
    )
    return fig


def decomposition_figure(tables: dict[str, Rows]) -> Any:
    series = _series(tables)
    fig, ax = _subplots(figsize=_bar_width(tables, 2))
    T = _horizons(tables)
    xs = range(len(series))

    def per_token(name: str) -> list[float]:
        return [_summary_row(tables, m, p, name)["estimate"] / T[m] for m, p in series]

    first = [_summary_row(tables, m, p, "first_mismatch")["estimate"] for m, p in series]
    window = per_token("window_contribution")
    tail = per_token("tail_contribution")
    exposure = per_token("tail_exposure")
    ax.bar(xs, first, label=label("first_mismatch"))
    ax.bar(xs, window, bottom=first, label="window (lags 1..L_w after tau)")
    low = [f + w for f, w in zip(first, window, strict=True)]
    seen = [t if t == t else 0.0 for t in tail]  # NaN: tail not observed
    if any(t > 0 for t in seen):  # no tail drawn, none named in the legend
        ax.bar(xs, seen, bottom=low, label="tail (lags > L_w)")
    unseen = [e if t != t else 0.0 for t, e in zip(tail, exposure, strict=True)]
    if any(unseen):
        ax.bar(xs, unseen, bottom=low, fill=False, hatch="//", label="unobserved tail (at most)")
    m_tot = [_summary_row(tables, m, p, "mismatch_fraction") for m, p in series]
    ax.errorbar(
        xs,
        [t["estimate"] for t in m_tot],
        yerr=[
            [t["estimate"] - t["ci_low"] for t in m_tot],
            [t["ci_high"] - t["estimate"] for t in m_tot],
        ],
        fmt="none",
        color="k",
        capsize=4,
    )
    ax.set_xticks(list(xs), _tick_labels(tables), fontsize=7)
    ax.set(ylabel=label("mismatch_fraction"), title="Decomposition of E[M]/T (black: CI)")
    _legend_outside(ax)
    return fig


def sharp_interval_figure(tables: dict[str, Rows]) -> Any:
    series = _series(tables)
    fig, ax = _subplots(figsize=_bar_width(tables))
    for i, (m, p) in enumerate(series):
        lo = _summary_row(tables, m, p, "interval_lower_fraction")
        hi = _summary_row(tables, m, p, "interval_upper_fraction")
        ax.vlines(i, lo["estimate"], hi["estimate"], lw=8, alpha=0.5)
        ax.vlines(i, lo["ci_low"], hi["ci_high"], lw=1, color="k")
        ax.plot(i, _summary_row(tables, m, p, "mismatch_fraction")["estimate"], "ko")
    ax.set_xticks(list(range(len(series))), _tick_labels(tables), fontsize=7)
    ax.set(ylabel=label("mismatch_fraction"), title="Sharp interval (bar), CI (line), point (dot)")
    return fig


def early_late_figure(tables: dict[str, Rows]) -> Any:
    series = _series(tables)
    fig, ax = _subplots(figsize=_bar_width(tables, 1.5))
    xs = range(len(series))
    width = 0.38
    for j, name in enumerate(("early_tv", "late_tv")):
        rows = [_summary_row(tables, m, p, name) for m, p in series]
        ax.bar(
            [i + (j - 0.5) * width for i in xs],
            [r["estimate"] for r in rows],
            width,
            yerr=[
                [r["estimate"] - r["ci_low"] for r in rows],
                [r["ci_high"] - r["estimate"] for r in rows],
            ],
            capsize=3,
            label="early lags 1..s" if name == "early_tv" else "late lags s+1..L_w",
        )
    ax.set_xticks(list(xs), _tick_labels(tables), fontsize=7)
    ax.set(ylabel="branch-aligned TV", title="Early vs late window")
    _legend_outside(ax)
    return fig


def early_late_split(result: AnalysisResult, analysis_window: int) -> int:
    """s, the last early lag of the early/late window split (default: half of L_w)."""
    split = result.settings.get("early_late_split")
    return analysis_window // 2 if split in (None, "half") else int(split)


def _split_words(result: AnalysisResult) -> dict[str, str]:
    """Each model's early/late split, for the early-vs-late caption."""
    several = len(result.models) > 1
    return {
        "split": "; ".join(
            f"{terminal(m.model) + ': ' if several else ''}"
            f"s = {early_late_split(result, m.obs_window)}, L_w = {m.obs_window}"
            for m in result.models
        )
    }


COLLAPSED = (
    " Here every branch was traced to the horizon (L >= T - 1), so nothing is unobserved: the "
    "interval collapses to the point estimate and no bar is drawn. It widens when branches "
    "are traced for fewer lags (`kvcouple trace --window L` with L < T)."
)


def _collapsed_words(result: AnalysisResult) -> dict[str, str]:
    """The sharp interval's note when every branch reached the horizon."""
    collapsed = all(m.window + 1 >= m.horizon for m in result.models)
    return {"collapsed": COLLAPSED if collapsed else ""}


@dataclass(frozen=True)
class ReportFigure:
    """One figure of the report: how it is drawn, its title and its caption. ``caption`` may
    name fields that ``run_words`` fills from the analysis (each model's window split, ...)."""

    draw: Callable[[dict[str, Rows]], Any]
    title: str
    caption: str
    run_words: Callable[[AnalysisResult], dict[str, str]] | None = None

    def caption_for(self, result: AnalysisResult) -> str:
        """The caption with this run's words filled in."""
        return self.caption.format(**self.run_words(result)) if self.run_words else self.caption


# Every figure by name, in the report's order.
FIGURES: dict[str, ReportFigure] = {
    "survival": ReportFigure(
        survival_figure,
        "Survival: no divergence yet",
        "S_t = P(tau > t), the share of trajectories still identical to the full-cache model "
        "after t tokens (bands: bootstrap CIs). Look at how fast each curve falls and where "
        "curves cross: a lower curve diverges earlier or more often.",
    ),
    "hazard": ReportFigure(
        hazard_figure,
        "Hazard by step",
        "The chance that the first divergence happens at step t, given none before. A high "
        "value at step 1 means eviction already changes the first next-token distribution; a "
        "rising hazard means the risk grows as generation proceeds.",
    ),
    "branch_tv_by_lag": ReportFigure(
        branch_tv_figure,
        "Branch-aligned TV by lag after the first divergence",
        "The mean TV between the two models' next-token distributions at each lag after the "
        "first divergence, over the branches traced (each replicate's branches weighted by its "
        "probability O of diverging at all, 'O-weighted', so that the mean is that of diverged "
        "trajectories). Lag 0 is the divergence step itself, whose TV is the (usually small) hazard that "
        "happened to produce different tokens; from lag 1 on, the two models continue from "
        "different prefixes and TV jumps, which is why rho is high. Only trajectories that "
        "diverged early reach the last lags, so the right end rests on few branches and is "
        "noisy (a spike there is not a finding): read it with its band.",
    ),
    "decomposition": ReportFigure(
        decomposition_figure,
        "Decomposition of E[M]/T",
        "Each bar stacks the first-mismatch contribution P(tau<=T)/T, the post-divergence "
        "mismatches inside the observation window (lags 1..L_w after the first divergence tau, "
        "L_w being the lags the analysis counts as observed) and, where any, those after it "
        "(the tail; hatched: unobserved, at most this much); the black line is the CI of "
        "E[M]/T. The parts above the first one are exposure x rho: compare their heights "
        "across policies to see whether a gap comes from diverging or from drifting.",
    ),
    "sharp_interval": ReportFigure(
        sharp_interval_figure,
        "Sharp interval of E[M]/T",
        "The range of E[M]/T compatible with what was observed (bar), the CI of its ends "
        "(thin line) and the point estimate when the tail was observed (dot).{collapsed}",
        _collapsed_words,
    ),
    "early_vs_late": ReportFigure(
        early_late_figure,
        "Early vs late branch-aligned TV",
        "Branch-aligned TV (O-weighted, as in the TV-by-lag figure) averaged over the early "
        "lags 1..s and the late lags s+1..L_w after divergence ({split}). Late above early "
        "means the two generations keep drifting apart instead of re-synchronising.",
        _split_words,
    ),
}
