"""The course's plots, in one style: memory per rank, bytes per collective, per-rank timelines, scaling.

Every function takes plain numbers (dicts of bytes, lists of spans) that a notebook got back from its ranks,
draws them, and returns the matplotlib Figure, its words in the notebook's language (zeroedu.lang, see
zeroedu.i18n.figures). Colours mean the same thing in every notebook: one colour per
memory category (zeroedu.memory.CATEGORIES) and one per collective. Theory is always drawn as a black
marker on top of the measured bar, so "measured = theory" is something you can see, not only read.

`table(...)` prints the same numbers as plain text: nbval compares text, not pixels. `approx(x)` prints a float
whose last digits depend on the CPU's vector kernels (a loss, say) as "≈4.8832": the course's nbval settings
(tests/nbval_sanitize.cfg) mask the digits after "≈", so the value is shown to the learner and never compared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from zeroedu.fmt import approx, byte_unit, fmt_bytes
from zeroedu.i18n import current
from zeroedu.i18n.figures import localize, use_cjk_font
from zeroedu.memory import CATEGORIES

__all__ = ["CATEGORY_COLORS", "OP_COLORS", "PHASE_COLORS", "alpha_beta_plot", "approx", "backward_segments",
           "block_errors", "fmt_bytes", "grouped_bars", "ledger_bars", "loss_curves", "memory_bars",
           "offload_timelines", "ring_grid", "scaling_plot", "table", "timeline", "timeline_data"]

# Titles a cell passes through tr() are drawn before localize() runs, so under zeroedu.lang("zh") (set in the
# Chinese notebooks' first cell, before anything imports this module) the font with Chinese glyphs comes first now.
if current() == "zh":
    use_cjk_font()

# One colour per memory category, in stacking order: model states first (the paper's three, plus fp32 master
# weights, which the paper counts inside K), then the "residual" memory that no model-state formula shows.
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "master_weights": "#55A868",
    "optimizer_state": "#C44E52",
    "buckets": "#8172B3",
    "gathered_parameters": "#64B5CD",
    "activations": "#DA8BC3",
    "temporaries": "#8C8C8C",
    "other": "#CCB974",
}
OP_COLORS: dict[str, str] = {
    "all_reduce": "#C44E52",
    "reduce_scatter": "#DD8452",
    "all_gather": "#4C72B0",
    "broadcast": "#8C8C8C",
    "all_to_all": "#8172B3",
    "send": "#55A868",
    "recv": "#55A868",
}
# Compute phases in pale hues of their own: no phase shares a colour family with a collective (issue 31: a blue
# forward box next to a blue all-gather read as one thing).
PHASE_COLORS: dict[str, str] = {"forward": "#BFE3DC", "backward": "#E9DDB8", "step": "#D9D9D9", "init": "#E6DDF2",
                                "other": "#EFEFEF"}
BACKWARD_ALT = "#D8C68F"   # every other per-bucket segment of backward, a darker shade of its colour
THEORY_COLOR = "black"

FIGSIZE = (7.5, 3.6)
DPI = 90
TITLE_SIZE, LABEL_SIZE, TICK_SIZE, LEGEND_SIZE = 10.5, 9.5, 8.5, 8

def table(rows: Iterable[Sequence], headers: Sequence[str], align: str | None = None) -> str:
    """A plain-text table (for print): columns padded to width, numbers right-aligned.

    `align` is one letter per column, 'l' or 'r'; by default text columns align left and numbers right.
    """
    rows = [["" if v is None else v for v in r] for r in rows]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"table: a row has {len(r)} cells but there are {len(headers)} headers: {r}")
    cells = [[str(v) for v in r] for r in rows]
    if align is None:
        align = "".join("r" if rows and all(isinstance(r[i], int | float) for r in rows) else "l"
                        for i in range(len(headers)))
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align,
                                                                                    strict=True)).rstrip()

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


# The style is applied to each figure explicitly rather than through rcParams: a plt.rc_context around the first
# pyplot figure of a Jupyter kernel restores `interactive` on exit and stops the inline backend from showing
# every later figure.
def _new_axes(ax, figsize=None):
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize or FIGSIZE, dpi=DPI)
    return fig, ax


def _apply_axes_style(ax, grid_axis: str = "y") -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(True, axis=grid_axis, alpha=0.3)
    ax.set_axisbelow(True)
    ax.title.set_fontsize(TITLE_SIZE)
    ax.xaxis.label.set_fontsize(LABEL_SIZE)
    ax.yaxis.label.set_fontsize(LABEL_SIZE)
    ax.tick_params(labelsize=TICK_SIZE)


def _legend(ax, **kw) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=LEGEND_SIZE, frameon=False, **kw)


def _theory_marker(ax, x: float, y: float, width: float, label: str | None) -> Line2D:
    (line,) = ax.plot([x - width / 2, x + width / 2], [y, y], color=THEORY_COLOR, lw=2.2, ls="-", solid_capstyle="butt",
                      label=label, zorder=5)
    line.set_gid("theory")
    return line


def _finish_axes(fig: Figure, ax, x, labels: Sequence[str], ylabel: str, title: str) -> Figure:
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax)
    _apply_axes_style(ax)
    fig.tight_layout()
    return localize(fig)


def _finish_bars(fig: Figure, ax, x, labels: list[str], theory: Mapping[str, float] | None, scale: float,
                 width: float, theory_label: str, ylabel: str, title: str) -> Figure:
    """A theory marker on each bar that has a value (the legend names the first), then ticks, labels, style."""
    first = True
    for i, b in enumerate(labels):
        if theory and b in theory and theory[b] is not None:
            _theory_marker(ax, x[i], theory[b] / scale, width * 1.15, theory_label if first else None)
            first = False
    return _finish_axes(fig, ax, x, labels, ylabel, title)


def memory_bars(per_bar: Mapping[str, Mapping[str, float]], theory: Mapping[str, float] | None = None,
                title: str = "Memory per rank, by category", unit: str | None = None, ax=None,
                categories: Sequence[str] | None = None, theory_label: str = "theory") -> Figure:
    """Stacked bars: one bar per key of `per_bar` (e.g. "stage 0"), one segment per memory category.

    per_bar: {bar label: {category: bytes}}, e.g. engine.memory()["resident"] from rank 0 of each stage.
    theory:  {bar label: bytes}, drawn as a black marker at that height on the bar (e.g. the model-state
             bytes from zeroedu.theory). Bars without a theory value get no marker.
    Categories stack in CATEGORIES order; categories that are zero in every bar are left out.
    """
    if not per_bar:
        raise ValueError("memory_bars: nothing to draw (per_bar is empty)")
    labels = list(per_bar)
    known = list(categories or CATEGORIES)
    extra = sorted({c for d in per_bar.values() for c in d} - set(known))
    cats = [c for c in known + extra if any(per_bar[b].get(c, 0) for b in labels)]
    totals = [sum(per_bar[b].get(c, 0) for c in cats) for b in labels]
    top = max(totals + [v for v in (theory or {}).values()] + [1])
    name, scale = byte_unit(top, unit)
    fig, ax = _new_axes(ax)
    x = np.arange(len(labels))
    width = 0.6
    bottom = np.zeros(len(labels))
    for c in cats:
        vals = np.array([per_bar[b].get(c, 0) for b in labels], dtype=float) / scale
        ax.bar(x, vals, width, bottom=bottom, label=c.replace("_", " "), color=CATEGORY_COLORS.get(c, "#999999"),
               edgecolor="white", linewidth=0.5)
        bottom += vals
    return _finish_bars(fig, ax, x, labels, theory, scale, width, theory_label, f"bytes per rank ({name})", title)


def _split_key(key: str) -> tuple[str, str]:
    phase, _, op = key.partition("/")
    return (phase, op) if op else ("", phase)


def ledger_bars(per_bar: Mapping[str, Mapping[str, float]], theory: Mapping[str, float] | None = None,
                title: str = "Bytes sent per rank in one optimizer step", unit: str | None = None,
                ax=None) -> Figure:
    """Stacked bars of the bytes a rank sent, one segment per "phase/op" (Ledger.per_step's keys).

    per_bar: {bar label: {"backward/reduce_scatter": bytes, "step/all_gather": bytes, ..., "total": bytes}}
             ("total" is ignored: the stack is the total).
    theory:  {bar label: bytes}, a black marker on each bar (e.g. zeroedu.theory.comm_bytes_per_step).
    """
    if not per_bar:
        raise ValueError("ledger_bars: nothing to draw (per_bar is empty)")
    labels = list(per_bar)
    phase_order = ["init", "forward", "backward", "step", "other", ""]
    keys = sorted({k for d in per_bar.values() for k in d if k != "total"},
                  key=lambda k: (phase_order.index(_split_key(k)[0]) if _split_key(k)[0] in phase_order
                                 else len(phase_order), k))
    keys = [k for k in keys if any(per_bar[b].get(k, 0) for b in labels)]
    totals = [sum(per_bar[b].get(k, 0) for k in keys) for b in labels]
    top = max(totals + list((theory or {}).values()) + [1])
    name, scale = byte_unit(top, unit)
    fig, ax = _new_axes(ax)
    x = np.arange(len(labels))
    width = 0.6
    bottom = np.zeros(len(labels))
    hatches = {"forward": "", "backward": "//", "step": "..", "init": "xx", "other": ""}
    for k in keys:
        phase, op = _split_key(k)
        vals = np.array([per_bar[b].get(k, 0) for b in labels], dtype=float) / scale
        ax.bar(x, vals, width, bottom=bottom, label=k.replace("_", "-"), color=OP_COLORS.get(op, "#999999"),
               hatch=hatches.get(phase, ""), edgecolor="white", linewidth=0.5)
        bottom += vals
    return _finish_bars(fig, ax, x, labels, theory, scale, width, "theory", f"bytes sent per rank ({name})", title)


def grouped_bars(groups: Mapping[str, Mapping[str, float]], title: str = "", ylabel: str = "",
                 ax=None, reference: float | None = None,
                 theory: Mapping[str, Mapping[str, float]] | None = None, theory_label: str = "theory") -> Figure:
    """Side-by-side bars: one group per key of `groups` (e.g. "stage 1"), one bar per series inside it (e.g.
    "claimed", "measured"), each labelled with its value. `reference` draws a dashed line at that height
    (e.g. 1.0 for ratios to a baseline). `theory` ({group: {series: value}}) draws the black theory marker on
    each bar that has a value."""
    if not groups:
        raise ValueError("grouped_bars: nothing to draw (groups is empty)")
    labels = list(groups)
    series = list(dict.fromkeys(k for g in groups.values() for k in g))
    fig, ax = _new_axes(ax)
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    colors = ["#BBBBBB", "#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    for i, name in enumerate(series):
        vals = [groups[g].get(name, np.nan) for g in labels]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name,
                      color=colors[i % len(colors)], edgecolor="white", linewidth=0.5, gid=f"series:{name}")
        ax.bar_label(bars, labels=[f"{v:g}" for v in vals], fontsize=TICK_SIZE, padding=2)
        for j, g in enumerate(labels):
            if theory and theory.get(g, {}).get(name) is not None:
                _theory_marker(ax, x[j] + (i - (len(series) - 1) / 2) * width, theory[g][name], width * 1.15,
                               theory_label if not any(ln.get_label() == theory_label for ln in ax.get_lines())
                               else None)
    if reference is not None:
        ax.axhline(reference, color=THEORY_COLOR, lw=1, ls="--", zorder=0)
    return _finish_axes(fig, ax, x, labels, ylabel, title)


def block_errors(errors: Sequence[float], bounds: Sequence[float], xlabel: str = "block", title: str = "",
                 measured_label: str = "largest |error| in the block (measured)",
                 bound_label: str = "bound") -> Figure:
    """One bar per block: the largest error measured in it, on a log axis, under a step line at the block's
    bound (e.g. qwZ's max|x| / 2L), so that a block over its bound, or one far above the others, stands out."""
    if len(errors) == 0 or len(errors) != len(bounds):
        raise ValueError(f"block_errors: {len(errors)} errors and {len(bounds)} bounds: give one of each per block")
    fig, ax = _new_axes(None, figsize=(7.5, 3))
    xs = np.arange(len(errors))
    ax.bar(xs, np.asarray(errors, dtype=float), color=OP_COLORS["all_gather"], label=measured_label)
    ax.step(xs, np.asarray(bounds, dtype=float), where="mid", color=THEORY_COLOR, label=bound_label)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("absolute error")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=LEGEND_SIZE, frameon=False)
    _apply_axes_style(ax)
    fig.tight_layout()
    return localize(fig)


def timeline_data(engine, since: float | None = None, step: int | None = None) -> dict:
    """What a rank returns for `timeline`: its compute phases and its collectives (picklable numbers).

    compute: [(phase, start, end)] from engine.timeline; comm: [(op, kind, phase, start, seconds, sent_bytes)]
    from the ledger; overlap: the engine's overlap_comm (whether backward's collectives block it). `since` (a
    time.time()) keeps only what started after it; `step` keeps only the collectives of that optimizer step
    (compute spans are kept by time, so combine it with `since`).
    """
    compute = [(p, s, e) for p, s, e in engine.timeline if since is None or s >= since]
    comm = [(e.op, e.kind, e.phase, e.start, e.seconds, e.sent_bytes) for e in engine.ledger
            if e.op not in ("skipped_step",) and (since is None or e.start >= since)
            and (step is None or e.step == step)]
    return {"rank": engine.rank, "compute": compute, "comm": comm, "overlap": bool(engine.overlap_comm)}


def backward_segments(start: float, end: float, comm: Sequence[Sequence], overlap: bool
                      ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Cut a backward span into the stretches between its collectives: (compute segments, waits).

    Each collective of backward starts when its bucket's last gradient exists, so the cuts are bucket
    boundaries. With overlap the rank computes on while the collective runs (segments touch); without it the
    rank waits for each one (a wait between two segments, as long as the collective). comm: the rank's
    (op, kind, phase, start, seconds, sent) entries of that backward."""
    cuts = sorted((c[3], c[3] + c[4]) for c in comm if start <= c[3] <= end)
    segments, waits, at = [], [], start
    for s, e in cuts:
        if s > at:
            segments.append((at, s))
        if overlap:
            at = max(at, s)
        else:
            e = min(e, end)
            if e > s:
                waits.append((s, e))
            at = max(at, e)
    if end > at:
        segments.append((at, end))
    return segments, waits


def timeline(ranks: Sequence[Mapping], title: str = "What each rank does, over time", ax=None,
             ms: bool = True, xmax: float | None = None) -> Figure:
    """Per-rank timeline: for each rank a compute lane (forward / backward / step) above a comm lane (one
    box per collective, coloured by op). `ranks` is the list of timeline_data(...) dicts, one per rank.

    Times are relative to the earliest start over all ranks (every rank runs on this machine, so their
    time.time() clocks agree). Where a rank says whether it overlapped (timeline_data's "overlap"), its
    backward is drawn in per-bucket segments (backward_segments), with hatched waits where it blocked on a
    collective: overlapped and inline reduction look different, not only last different. `xmax` (in the
    x axis's unit) fixes the x range, so that timelines compared side by side share it.
    """
    if not ranks:
        raise ValueError("timeline: no ranks to draw")
    starts = [s for r in ranks for _, s, _ in r["compute"]] + [c[3] for r in ranks for c in r["comm"]]
    if not starts:
        raise ValueError("timeline: the ranks recorded no compute phase and no collective")
    t0 = min(starts)
    k = 1e3 if ms else 1.0
    fig, ax = _new_axes(ax, figsize=(8.5, 0.9 + 0.75 * len(ranks)))
    seen_phase, seen_op = [], []
    for i, r in enumerate(ranks):
        y = len(ranks) - 1 - i
        for phase, s, e in r["compute"]:
            spans, waits = [(s, e)], []
            if phase == "backward" and "overlap" in r:
                spans, waits = backward_segments(s, e, [c for c in r["comm"] if c[2] == "backward"], r["overlap"])
            for j, (a, b) in enumerate(spans):   # one segment per bucket: alternate shades show the cuts
                color = PHASE_COLORS.get(phase, "#ccc") if j % 2 == 0 else BACKWARD_ALT
                ax.broken_barh([((a - t0) * k, (b - a) * k)], (y + 0.05, 0.38), facecolors=color,
                               edgecolor="white", linewidth=0.4, gid=f"compute:{phase}")
            for a, b in waits:
                ax.broken_barh([((a - t0) * k, (b - a) * k)], (y + 0.05, 0.38), facecolors="white",
                               edgecolor="#999999", hatch="////", linewidth=0.4, gid="wait:comm")
            if phase not in seen_phase:
                seen_phase.append(phase)
            if waits and "wait" not in seen_phase:
                seen_phase.append("wait")
        for op, _kind, _phase, s, sec, _sent in r["comm"]:
            ax.broken_barh([((s - t0) * k, max(sec, 1e-6) * k)], (y - 0.43, 0.38), facecolors=OP_COLORS.get(op, "#999"),
                           edgecolor="black", linewidth=0.3, gid=f"comm:{op}")
            if op not in seen_op:
                seen_op.append(op)
    ax.set_yticks([len(ranks) - 1 - i for i in range(len(ranks))],
                  [f"rank {r.get('rank', i)}" for i, r in enumerate(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlabel("time (ms)" if ms else "time (s)")
    if xmax is not None:   # the same x range for timelines that are compared side by side
        ax.set_xlim(0, xmax)
    ax.set_title(title)
    handles = [Patch(facecolor="white", edgecolor="#999999", hatch="////", label="backward waits for its collective")
               if p == "wait" else Patch(facecolor=PHASE_COLORS.get(p, "#ccc"), label=f"compute: {p}")
               for p in seen_phase]
    handles += [Patch(facecolor=OP_COLORS.get(o, "#999"), edgecolor="black", label=o.replace("_", "-"))
                for o in seen_op]
    _legend(ax, handles=handles)
    _apply_axes_style(ax, grid_axis="x")
    fig.tight_layout()
    return localize(fig)


def scaling_plot(measured: Mapping[str, Mapping[int, float]], theory: Mapping[str, Mapping[int, float]] | None = None,
                 title: str = "Model-state bytes per rank vs number of ranks", unit: str | None = None,
                 ax=None, logy: bool = False, xlabel: str = "data-parallel ranks N",
                 ylabel: str = "bytes per rank", floors: Mapping[str, float] | None = None) -> Figure:
    """Measured points (one series per stage, {N: bytes}) over theory curves drawn as lines.

    The x axis is log2 with a tick at every measured or theory x; a linear y axis starts at 0, so heights compare as
    ratios. `xlabel`/`ylabel` name other sweeps (e.g. bytes sent per step against gradient accumulation steps).
    `floors` ({label: bytes}) draws dashed horizontal lines, e.g. the limits 4Psi and 2Psi that stages 1 and 2
    approach as N grows."""
    if not measured:
        raise ValueError("scaling_plot: nothing to draw")
    top = max([v for d in measured.values() for v in d.values()]
              + [v for d in (theory or {}).values() for v in d.values()] + list((floors or {}).values()) + [1])
    name, scale = byte_unit(top, unit)
    fig, ax = _new_axes(ax)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, pts) in enumerate(measured.items()):
        c = colors[i % len(colors)]
        if theory and label in theory:
            ns = sorted(theory[label])
            (line,) = ax.plot(ns, [theory[label][n] / scale for n in ns], color=c, lw=1.5, alpha=0.7,
                              label=f"{label}: theory")
            line.set_gid("theory")
        ns = sorted(pts)
        (line,) = ax.plot(ns, [pts[n] / scale for n in ns], "o", color=c, ms=7, mfc="none", mew=2,
                          label=f"{label}: measured")
        line.set_gid("measured")
    # a tick at every measured x and at every power of 2 a curve reaches: curves drawn past the last measured x
    # (07: to N = 64) keep labelled ticks, and a smooth curve's many x values do not each get one
    xs = [n for d in measured.values() for n in d] + [n for d in (theory or {}).values() for n in d]
    lo, hi = min(xs), max(xs)
    powers = {2 ** k for k in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1) if lo <= 2 ** k <= hi}
    ns = sorted({n for d in measured.values() for n in d} | powers)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    for label, y in (floors or {}).items():
        line = ax.axhline(y / scale, color=THEORY_COLOR, lw=1, ls="--", alpha=0.6, zorder=0)
        line.set_gid("floor")
        ax.annotate(label, (1.0, y / scale), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=TICK_SIZE)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel} ({name})")
    ax.set_title(title)
    _legend(ax)
    _apply_axes_style(ax)
    fig.tight_layout()
    return localize(fig)


def loss_curves(curves: Mapping[str, Sequence[float] | tuple[Sequence[float], Sequence[float]]],
                reference: str | None = None, relative: bool = False, mark: float | None = None,
                title: str = "", figsize: tuple[float, float] | None = None) -> Figure:
    """Loss per optimizer step, one line per run: {label: losses} (steps 0, 1, ...) or {label: (steps, losses)}.

    `reference` names the run the others are compared with: drawn as a wide grey band under them, so that a run
    on top of it is visibly the same. `relative` adds a second panel, 100 (loss - reference) / reference per
    step, for differences too small to see on the first. `mark` draws a dotted vertical line at that step (e.g.
    where a run was saved and resumed)."""
    if not curves:
        raise ValueError("loss_curves: nothing to draw (curves is empty)")
    if reference is not None and reference not in curves:
        raise ValueError(f"loss_curves: reference {reference!r} is not one of the curves {sorted(curves)}")
    if relative and reference is None:
        raise ValueError("loss_curves: relative=True needs a reference curve")
    series = {k: (list(v[0]), list(v[1])) if isinstance(v, tuple) else (list(range(len(v))), list(v))
              for k, v in curves.items()}
    fig, axes = plt.subplots(1, 2 if relative else 1, figsize=figsize or ((8.5, 3.4) if relative else FIGSIZE),
                             dpi=DPI, squeeze=False)
    ax = axes[0][0]
    styles = ["o-", "s-", "d-", "^-", "v-", "x-", ":"]
    others = [k for k in series if k != reference]
    if reference is not None:
        ax.plot(*series[reference], color="0.6", lw=5, alpha=0.5, label=reference)
    for i, k in enumerate(others):
        ax.plot(*series[k], styles[i % len(styles)], ms=3, lw=1, label=k)
    if mark is not None:
        ax.axvline(mark, color=THEORY_COLOR, ls=":", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title(title)
    ax.legend(fontsize=LEGEND_SIZE, frameon=False)
    _apply_axes_style(ax)
    if relative:
        ax2, ref = axes[0][1], dict(zip(*series[reference], strict=True))
        ax2.axhline(0, color="0.6", lw=5, alpha=0.5)
        for i, k in enumerate(others):
            xs, ys = series[k]
            ax2.plot(xs, [100 * (y - ref[x]) / ref[x] for x, y in zip(xs, ys, strict=True)],
                     styles[i % len(styles)], ms=3, lw=1, label=k)
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel(f"(loss - {reference}) / {reference}, %")
        ax2.set_title("the difference, magnified")
        _apply_axes_style(ax2)
    fig.tight_layout()
    return localize(fig)


def alpha_beta_plot(sizes: Sequence[float], seconds: Mapping[str, Sequence[float]], world_size: int,
                    fit: tuple[float, float] | None = None, title: str = "Collective time vs message size",
                    ax=None) -> Figure:
    """Measured time per collective ({op: [seconds per size]}) and the alpha-beta model's lines.

    fit: (alpha seconds per ring step, beta bytes per second), as zeroedu.theory.fit_alpha_beta returns; the
    line of each op is zeroedu.theory.collective_time(op, S, world_size, alpha, beta).
    """
    from zeroedu.theory import collective_time

    fig, ax = _new_axes(ax)
    xs = np.asarray(sizes, dtype=float)
    markers, styles = ["o", "s", "^", "D", "v"], ["-", "--", ":", "-."]
    for i, (op, ts) in enumerate(seconds.items()):
        ax.plot(xs, np.asarray(ts) * 1e3, markers[i % len(markers)], color=OP_COLORS.get(op), mfc="none", mew=1.5,
                label=f"{op.replace('_', '-')}: measured", gid="measured")
    if fit is not None:
        # Ops whose model is the same curve (reduce-scatter and all-gather: N-1 steps, (N-1)/N S bytes each) get
        # one line, named after all of them, so no line hides under another.
        grid = np.geomspace(xs.min(), xs.max(), 50)
        curves: dict[tuple, list[str]] = {}
        for op in seconds:
            curves.setdefault(tuple(collective_time(op, int(g), world_size, *fit) for g in grid), []).append(op)
        for j, (model, ops) in enumerate(curves.items()):
            names = " = ".join(o.replace("_", "-") for o in ops)
            ax.plot(grid, np.asarray(model) * 1e3, styles[j % len(styles)], color=OP_COLORS.get(ops[0]), lw=1.6,
                    alpha=0.8, label=f"{names}: alpha-beta", gid="theory")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")      # "20", not "2 x 10^1", on a log axis of milliseconds
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (ms)")
    if fit is not None:
        title += f"\nalpha = {fit[0] * 1e6:.0f} us per ring step, beta = {fit[1] / 1e9:.2f} GB/s (N = {world_size})"
    ax.set_title(title)
    _legend(ax)
    _apply_axes_style(ax)
    fig.tight_layout()
    return localize(fig)


def ring_grid(states: Sequence[np.ndarray], titles: Sequence[str] | None = None,
              suptitle: str = "Ring reduce-scatter, step by step") -> Figure:
    """One panel per ring step: rows are ranks, columns are chunks, each cell shows which ranks' data
    that chunk already sums (a bitmask: bit r set = rank r's contribution is in it).

    states: list of (N, N) integer arrays, states[s][rank, chunk] = bitmask after step s. A full chunk
    (all N bits) is drawn dark; a cell this rank no longer needs is drawn faint if its value is 0.
    """
    if not states:
        raise ValueError("ring_grid: no states to draw")
    n = states[0].shape[0]
    full = (1 << n) - 1
    fig, axes = plt.subplots(1, len(states), figsize=(2.3 * len(states), 2.6), dpi=DPI, squeeze=False)
    cmap = plt.get_cmap("Blues")
    for s, (ax, st) in enumerate(zip(axes[0], states, strict=True)):
        st = np.asarray(st)
        counts = np.vectorize(lambda v: bin(int(v)).count("1"))(st)
        ax.imshow(counts, cmap=cmap, vmin=0, vmax=n + 1)
        for r in range(n):
            for c in range(n):
                v = int(st[r, c])
                text = "all" if v == full else "+".join(str(i) for i in range(n) if v >> i & 1) or "-"
                ax.text(c, r, text, ha="center", va="center", fontsize=7 if n <= 4 else 5,
                        color="white" if counts[r, c] > n / 2 else "black")
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"r{r}" for r in range(n)], fontsize=7)
        ax.set_title(titles[s] if titles else f"after step {s}", fontsize=9)
        ax.grid(False)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return localize(fig)


# ---- notebook 08_offload ----------------------------------------------------------------------------------------
OFFLOAD_LANES = ("compute", "cpu adam", "d2h", "h2d", "nvme2h", "h2nvme", "collectives")
# Colours of their own: the collectives keep OP_COLORS (all-gather blue, reduce-scatter orange) in the last lane.
OFFLOAD_COLORS = {"cpu adam": "#8172B3", "d2h": "#937860", "h2d": "#DA8BC3", "nvme2h": "#55A868", "h2nvme": "#CCB974"}
OFFLOAD_LANE_LABELS = {"d2h": "device -> host", "h2d": "host -> device", "nvme2h": "NVMe -> host",
                       "h2nvme": "host -> NVMe", "cpu adam": "Adam on the host CPU"}


def offload_timelines(steps: Mapping[str, Mapping], min_width: float = 1 / 400) -> Figure:
    """One step of one rank per panel ({title: step}), a lane each for compute, the host's Adam, every kind of
    copy between tiers and the collectives. A step is {"t0", "compute": [(phase, start, end)], "adam": [(what,
    start, end)], "events": [(op, kind, start, seconds)]}, as zeroedu.course.offload_runs returns it.

    The panels share one x axis (ms since each step started), so their lengths compare; copies shorter than
    `min_width` of the longest step are drawn that wide, so that they can be seen. The legend names every lane's
    colours: the compute phases, the host optimizer, each direction of copy and each collective."""
    if not steps:
        raise ValueError("offload_timelines: no step to draw")
    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 0.6 + 2.9 * len(steps)), dpi=DPI, sharex=True,
                             squeeze=False)
    span = max(max(e for _, _, e in tl["compute"]) - tl["t0"] for tl in steps.values())
    seen_ops: list[str] = []
    for ax, (title, tl) in zip(axes[:, 0], steps.items(), strict=True):
        t0 = tl["t0"]

        def bar(lane: str, start: float, seconds: float, color: str, gid: str, ax=ax, t0=t0) -> None:
            ax.broken_barh([((start - t0) * 1e3, max(seconds, span * min_width) * 1e3)],
                           (OFFLOAD_LANES.index(lane) - 0.4, 0.8), facecolors=color, gid=gid)

        for phase, s, e in tl["compute"]:
            bar("compute", s, e - s, PHASE_COLORS.get(phase, "#ccc"), f"compute:{phase}")
        for _, s, e in tl["adam"]:
            bar("cpu adam", s, e - s, OFFLOAD_COLORS["cpu adam"], "cpu adam")
        for op, kind, s, sec in tl["events"]:
            if kind == "offload":
                bar(op, s, sec, OFFLOAD_COLORS.get(op, "#999"), f"offload:{op}")
            else:
                bar("collectives", s, sec, OP_COLORS.get(op, "#999"), f"comm:{op}")
                if op not in seen_ops:
                    seen_ops.append(op)
        ax.set_yticks(range(len(OFFLOAD_LANES)), OFFLOAD_LANES)
        ax.set_ylim(len(OFFLOAD_LANES) - 0.5, -0.5)
        ax.set_title(title)
        _apply_axes_style(ax, grid_axis="x")
    axes[-1, 0].set_xlabel("ms since the step started")
    handles = [Patch(facecolor=PHASE_COLORS[p], label=f"compute: {p}") for p in ("forward", "backward", "step")]
    handles += [Patch(facecolor=OFFLOAD_COLORS[k], label=OFFLOAD_LANE_LABELS[k]) for k in OFFLOAD_COLORS]
    handles += [Patch(facecolor=OP_COLORS.get(o, "#999"), label=f"collective: {o.replace('_', '-')}")
                for o in seen_ops]
    _legend(axes[0, 0], handles=handles)
    fig.tight_layout()
    return localize(fig)
