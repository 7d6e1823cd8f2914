"""Who holds what, when: each rank's tensors by category at each moment of a step, read off the live engine.

`watch(engine)` records a Frame at these moments of the next step (the engine's own tensors, engine.owned(), each
storage once, as zeroedu.memory.resident counts them):

    after forward            stage 3: "after forward of unit k", one per unit, before the unit is released
    backward: bucket b       after bucket b's gradients were handed to its reduction (stage 3: unit b)
    after reduce             backward is over and its collectives have finished
    after the optimizer step the master pieces are updated (before they are published)
    after the all-gather     every rank has the new parameters
    end of step              step() returned (the gradients zeroed, buffers of the step let go)

A Holding says which piece of which buffer it is ("whole", "piece r of N", "bucket b, piece r of N",
"unit k, whole"; with ZeRO++'s hpZ the second, node-local partition is a buffer of its own, "hpZ secondary copy",
"piece l of M (node g)"), its dtype and bytes, and whether it is temporary: gone by the end of the step (gathered
units, bucket buffers, full gradients waiting for their bucket). With offload, `tiers` has the bytes by category on
the host and NVMe (engine.tier_bytes()). `figure(...)` draws stages side by side at one moment:
a row per rank, a bar per category, bar length the bytes, temporary bytes hatched.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from zeroedu.memory import CATEGORIES

AFTER_STEP = "after the optimizer step"
AFTER_GATHER = "after the all-gather"
AFTER_REDUCE = "after reduce"
END = "end of step"

# The Chinese of these figures' words, added to zeroedu.i18n.figures' catalogue when this module loads.
ZH_PHRASES = {"Who holds what": "谁持有什么", "Who holds what, moment by moment": "谁持有什么：逐时刻",
              "Who holds what after the optimizer step": "优化器步之后谁持有什么",
              "Who holds what during a stage-2 step": "stage 2 一步之中谁持有什么",
              "Who holds what during a stage-3 step": "stage 3 一步之中谁持有什么",
              "Who holds what, stages 0-3, after the optimizer step": "stage 0-3 优化器步之后谁持有什么",
              "Who holds what with the optimizer offloaded": "优化器卸载后谁持有什么",
              "Who holds what with hpZ": "开启 hpZ 后谁持有什么",
              "temporary": "临时（本步结束前释放）", "after forward": "前向之后", AFTER_REDUCE: "归约之后",
              AFTER_STEP: "优化器步之后", AFTER_GATHER: "all-gather 之后", END: "本步结束"}
ZH_PATTERNS = [(r"^after forward of unit (\d+)$", r"unit \1 前向之后"), (r"^backward: bucket (\d+)$", r"反向：桶 \1"),
               (r"^backward: unit (\d+)$", r"反向：unit \1"),
               (r"^ \+ ([\d.]+) MB on the host$", r" + \1 MB 在主机内存"),
               (r"^ \+ ([\d.]+) MB on the nvme$", r" + \1 MB 在 NVMe")]


def register_zh(phrases: Mapping[str, str], patterns: Sequence[tuple[str, str]]) -> None:
    """Add entries to the figures' catalogue (zeroedu.i18n.figures), patterns before its catch-all ones."""
    import re

    from zeroedu.i18n import figures

    for k, v in phrases.items():
        figures.PHRASES.setdefault(k, v)
    known = {p.pattern for p, _ in figures.PATTERNS}
    figures.PATTERNS[:0] = [(re.compile(p), r) for p, r in patterns if p not in known]


register_zh(ZH_PHRASES, ZH_PATTERNS)


@dataclass(frozen=True)
class Holding:
    category: str
    buffer: str        # what it is: "parameters", "master weights", "exp_avg", "unit 3 buffer" ...
    piece: str         # which part of the flat layout: "whole", "piece 1 of 4", "bucket 2, piece 1 of 4", ...
    dtype: str
    numel: int
    nbytes: int
    temporary: bool = False


@dataclass
class Frame:
    """What one rank holds at one moment."""

    moment: str
    rank: int
    holdings: list[Holding] = field(default_factory=list)    # on the device
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)   # offload: bytes by category on "host", "nvme"

    def bytes_by_category(self, temporary: bool | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for h in self.holdings:
            if temporary is None or h.temporary == temporary:
                out[h.category] += h.nbytes
        return dict(out)


def _describe(engine) -> dict[int, tuple[str, str]]:
    """storage identity -> (buffer, piece) for the tensors whose role the engine's structure says."""
    n, r = engine.world_size, engine.rank
    out: dict[int, tuple[str, str]] = {}
    shard_piece = f"piece {r} of {n}" if n > 1 else "whole"
    pieces_in: dict[int, int] = defaultdict(int)    # master pieces may be views of one flat buffer
    for m in engine.master_pieces:
        pieces_in[m.untyped_storage()._cdata] += 1
    for i, m in enumerate(engine.master_pieces):
        st = m.untyped_storage()
        if pieces_in[st._cdata] > 1:
            piece = _piece(engine, st.nbytes() // m.element_size())
        else:
            piece = f"bucket {i}, {shard_piece}" if engine.sharded else f"bucket {i}, whole"
        out.setdefault(st._cdata, ("master weights", piece))
        for k, v in engine.optimizer.state.get(m, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out.setdefault(v.untyped_storage()._cdata, (k, piece))
    secondary = getattr(engine, "secondary", None)     # ZeRO++'s hpZ: a second, node-local partition
    if isinstance(secondary, torch.Tensor) and secondary.numel():
        m = engine.node_size                              # node g is ranks g*m .. g*m+m-1
        out.setdefault(secondary.untyped_storage()._cdata,
                       ("hpZ secondary copy", f"piece {r % m} of {m} (node {r // m})"))
    for u, buf in getattr(engine, "unit_buffers", {}).items():
        out.setdefault(buf.untyped_storage()._cdata, (f"unit {u} buffer", f"unit {u}, whole"))
    for u, buf in getattr(engine, "gathered", {}).items():
        if isinstance(buf, torch.Tensor):
            out.setdefault(buf.untyped_storage()._cdata, (f"unit {u}", f"unit {u}, whole"))
    return out


def _piece(engine, numel: int) -> str:
    layout, n = engine.layout, engine.world_size
    if numel == layout.full_numel:
        return "whole"
    if numel == layout.shard_numel and n > 1:
        return f"piece {engine.rank} of {n}"
    return f"{numel:,} elements"


def frame(engine, moment: str) -> Frame:
    """What `engine`'s rank holds now, by category; each storage once (first category wins, as resident())."""
    described = _describe(engine)
    seen: set[int] = set()
    out = Frame(moment, engine.rank, tiers={t: {c: b for c, b in by.items() if b}
                                            for t, by in engine.tier_bytes().items()})
    for cat, tensors in engine.owned().items():
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st._cdata in seen:
                continue
            seen.add(st._cdata)
            numel = st.nbytes() // t.element_size()
            buffer, piece = described.get(st._cdata, (cat.replace("_", " "), _piece(engine, numel)))
            out.holdings.append(Holding(cat, buffer, piece, str(t.dtype).removeprefix("torch."), numel,
                                        st.nbytes()))
    out.holdings.sort(key=lambda h: (CATEGORIES.index(h.category) if h.category in CATEGORIES else 99, h.buffer))
    return out


class Watch:
    """Frames of `engine`'s next optimizer step (watch(engine) starts one; `frames` fills in as it runs)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.frames: list[Frame] = []
        self.active = False
        self._storages_at_end: set[int] | None = None
        self._wrap()

    def _take(self, moment: str) -> None:
        if self.active:
            self.frames.append(frame(self.engine, moment))

    def _after(self, name: str, moment) -> None:
        fn = getattr(self.engine, name)

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            out = fn(*args, **kw)
            self._take(moment(*args, **kw) if callable(moment) else moment)
            return out
        setattr(self.engine, name, wrapper)

    def _wrap(self) -> None:
        e = self.engine
        word = "unit" if e.stage == 3 else "bucket"
        self._after("post_backward", lambda b: f"backward: {word} {b.index}")
        self._after("backward", AFTER_REDUCE)
        self._after("optimizer_step", AFTER_STEP)
        self._after("publish", AFTER_GATHER)
        step = e.step

        @functools.wraps(step)
        def step_and_look():
            before = e.global_step
            step()
            if e.global_step != before:    # an optimizer step, not a micro-step of accumulation
                self._take(END)
        e.step = step_and_look
        units = [m for m in getattr(e, "unit_modules", []) if m is not e.module]
        if units:   # prepend: before the engine's own hook releases the unit
            for k, m in enumerate(getattr(e, "unit_modules", [])):
                if m is not e.module:
                    m.register_forward_hook(lambda *_, k=k: self._take(f"after forward of unit {k}"), prepend=True)
        e.module.register_forward_hook(lambda *_: self._take("after forward"), prepend=True)

    def finish(self) -> list[Frame]:
        """Stop watching; mark as temporary what no longer exists at the end of the step."""
        self.active = False
        if not self.frames:
            return []
        final = {(h.buffer, h.piece, h.dtype, h.nbytes) for h in self.frames[-1].holdings}
        for f in self.frames:
            f.holdings = [h if (h.buffer, h.piece, h.dtype, h.nbytes) in final else
                          Holding(h.category, h.buffer, h.piece, h.dtype, h.numel, h.nbytes, True)
                          for h in f.holdings]
        return self.frames


def holdings_rank(rank: int, world_size: int, configs: Mapping[str, Mapping], steps: int = 2, watch_step: int = 1,
                  global_batch: int = 8, model_cfg=None) -> dict[str, dict]:
    """For zeroedu.launch: for each named config, train `steps` steps and watch step `watch_step`; returns
    {name: {"frames": this rank's frames of that step, "layout": bucket sizes, "units": stage3_units}}."""
    import zeroedu
    from zeroedu.course.basics import build_model, one_step, stage3_units

    out = {}
    for name, config in configs.items():
        engine, *_ = zeroedu.initialize(model=build_model(model_cfg), config=dict(config))
        w = Watch(engine)
        for step in range(steps):
            w.active = step == watch_step
            one_step(engine, step, global_batch, model_cfg, rank, world_size)
        out[name] = {"frames": w.finish(), "layout": [b.numel for b in engine.layout.buckets],
                     "units": stage3_units(engine), "ledger": engine.ledger.select(step=watch_step)}
    return out


@dataclass
class Holdings:
    """holdings_run's result: frames[name][rank] is that rank's list of Frames; layouts[name] the bucket sizes
    (elements, before padding); units[name] course.stage3_units of the engine (None below stage 3);
    ledgers[name][rank] that rank's ledger of the watched step (zeropp.where_bytes_go takes the list)."""

    frames: dict[str, list[list[Frame]]]
    layouts: dict[str, list[int]]
    units: dict[str, dict | None]
    ledgers: dict[str, list] = field(default_factory=dict)

    def at(self, name: str, moment: str) -> list[Frame]:
        """Each rank's first frame at `moment` (e.g. AFTER_STEP) in run `name`."""
        out = []
        for frames in self.frames[name]:
            match = [f for f in frames if f.moment == moment]
            if not match:
                raise KeyError(f"no frame {moment!r} in run {name!r}; its moments: "
                               f"{list(dict.fromkeys(f.moment for f in frames))}")
            out.append(match[0])
        return out


def holdings_run(configs: Mapping[str, Mapping], world_size: int = 2, steps: int = 2, watch_step: int = 1,
                 global_batch: int = 8, model_cfg=None, **launch_kw) -> Holdings:
    """Watch one step of each config on world_size ranks, in one launch (global_batch and model_cfg as
    course.train's: the configs' micro-batches must split that global batch)."""
    import zeroedu

    if not 0 <= watch_step < steps:
        raise ValueError(f"watch_step={watch_step} is not one of the {steps} steps run (0 to {steps - 1})")
    results = zeroedu.launch(holdings_rank, world_size=world_size,
                             args=(dict(configs), steps, watch_step, global_batch, model_cfg), **launch_kw)
    return Holdings({name: [r[name]["frames"] for r in results] for name in configs},
                    {name: results[0][name]["layout"] for name in configs},
                    {name: results[0][name]["units"] for name in configs},
                    {name: [r[name]["ledger"] for r in results] for name in configs})


def figure(runs: Mapping[str, Sequence[Frame]], title: str = "Who holds what", unit: float = 1e6):
    """Runs side by side (e.g. stages 0-3 at AFTER_STEP): a row per rank, one bar per category, its length the
    bytes (MB), hatched where temporary."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from zeroedu.i18n.figures import localize

    colors = dict(zip(CATEGORIES, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False))
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 0.5 + 0.9 * max(len(f) for f in runs.values())),
                             sharex=True, sharey=True, squeeze=False)
    used: set[str] = set()
    for ax, (name, frames) in zip(axes[0], runs.items(), strict=True):
        for row, fr in enumerate(frames):
            left = 0.0
            for cat in CATEGORIES:
                for temporary in (False, True):
                    nbytes = sum(h.nbytes for h in fr.holdings if h.category == cat and h.temporary == temporary)
                    if not nbytes:
                        continue
                    used.add(cat)
                    ax.barh(row, nbytes / unit, left=left, color=colors[cat], edgecolor="white",
                            hatch="//" if temporary else None, height=0.7)
                    left += nbytes / unit
            for tier, by in fr.tiers.items():   # offloaded bytes: said at the end of the device's bar
                if sum(by.values()):
                    ax.text(left, row, f" + {sum(by.values()) / unit:.2f} MB on the {tier}", va="center",
                            fontsize=7)
        ax.set_title(name)
        ax.set_yticks(range(len(frames)), [f"rank {f.rank}" for f in frames])
        ax.set_xlabel("MB")
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].invert_yaxis()   # once: the panels share their y axis, so inverting each would undo it in pairs
    handles = [Patch(color=colors[c], label=c.replace("_", " ")) for c in CATEGORIES if c in used]
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="temporary"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return localize(fig)


# -- reading frames: rows, a strip of moments, a widget to step through them ------------------------------------
def moments(frames: Sequence[Frame]) -> list[str]:
    """The moments of one rank's frames, in the order they happened."""
    return list(dict.fromkeys(f.moment for f in frames))


def rows(fr: Frame) -> list[list]:
    """One row per (category, buffer, dtype, temporary): [category, buffer, which pieces, dtype, bytes, temporary];
    the many pieces of one buffer (a piece per bucket) are one row that names the first and the last."""
    groups: dict[tuple, list[Holding]] = {}
    for x in fr.holdings:
        groups.setdefault((x.category, x.buffer, x.dtype, x.temporary), []).append(x)
    out = []
    for (cat, buffer, dtype, temporary), xs in groups.items():
        piece = xs[0].piece if len(xs) == 1 else f"{len(xs)} pieces: {xs[0].piece} ... {xs[-1].piece}"
        out.append([cat.replace("_", " "), buffer, piece, dtype, sum(x.nbytes for x in xs), temporary])
    for tier, by in fr.tiers.items():
        out += [[cat.replace("_", " "), f"on the {tier}", "-", "-", nbytes, False] for cat, nbytes in by.items()]
    return out


def strip(frames_by_rank: Sequence[Sequence[Frame]], chosen: Sequence[str] | None = None,
          title: str = "Who holds what, moment by moment"):
    """A static strip of frames (for readers without a kernel): one panel per moment (default: after forward,
    the middle of backward, after reduce, after the optimizer step, end of step), a row per rank."""
    all_moments = moments(frames_by_rank[0])
    if chosen is None:
        backward = [m for m in all_moments if m.startswith("backward: ")]
        firsts = [m for m in all_moments if m.startswith("after forward")]
        chosen = [m for m in [firsts[len(firsts) // 2] if firsts else None,
                              backward[len(backward) // 2] if backward else None,
                              AFTER_REDUCE, AFTER_STEP, END] if m in all_moments]
    runs = {}
    for m in chosen:
        if m not in all_moments:
            raise KeyError(f"no frame {m!r}; the moments recorded: {all_moments}")
        runs[m] = [next(f for f in frames if f.moment == m) for frames in frames_by_rank]
    return figure(runs, title=title)


class Stepper:
    """Step through one run's moments with a slider: the ranks' bars at that moment and rank 0's holdings table.
    Displays as its widget; a saved notebook keeps the text of the last moment shown and its picture."""

    def __init__(self, frames_by_rank: Sequence[Sequence[Frame]], name: str = "") -> None:
        import ipywidgets as widgets

        self.frames_by_rank, self.name = frames_by_rank, name
        self.moments = moments(frames_by_rank[0])
        self.slider = widgets.SelectionSlider(options=self.moments, value=self.moments[0], description="moment",
                                              continuous_update=False, layout={"width": "90%"},
                                              style={"description_width": "initial"})
        self.image = widgets.Image(format="png")
        self.table = widgets.HTML()
        self.widget = widgets.VBox([self.slider, self.image, self.table])
        self.slider.observe(self.update, names="value")
        self.text, self.png = "", b""
        self.update()

    def frames_at(self, moment: str) -> list[Frame]:
        return [next(f for f in frames if f.moment == moment) for frames in self.frames_by_rank]

    def update(self, _change=None) -> None:
        import html
        import io

        import matplotlib.pyplot as plt

        from zeroedu.course.basics import markdown_table

        moment = self.slider.value
        fig = figure({moment: self.frames_at(moment)}, title=self.name or "Who holds what")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        self.png = self.image.value = buf.getvalue()
        first = self.frames_at(moment)[0]
        self.text = f"rank {first.rank}, {moment}:\n" + markdown_table(
            rows(first), ["category", "buffer", "piece", "dtype", "bytes", "temporary"])
        self.table.value = f"<pre style='font-size: 11px'>{html.escape(self.text)}</pre>"

    def __repr__(self) -> str:
        return self.text

    def _repr_mimebundle_(self, **kwargs):
        import base64

        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/plain"] = self.text
        data["image/png"] = base64.b64encode(self.png).decode("ascii")
        return bundle
