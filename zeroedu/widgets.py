"""ipywidgets calculators, each a thin layer over a pure function that returns text.

    from zeroedu.widgets import memory_calculator, planner_widget
    memory_calculator()      # model size, N, stage, precision, offload -> bytes per rank and comm per step
    planner_widget()         # zeroedu.planner.plan for a model and a cluster

The text functions (`calculator_text`, `planner_text`) hold all the arithmetic and are what the tests check;
a widget only reads its controls and shows the text. Set a control's `.value` from Python and `.text`
follows, which is how the tests drive them (and how a notebook can, without a browser).
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as widgets

from zeroedu import planner, theory

GB = theory.GB
OFFLOADS = {   # label -> (offload_optimizer, offload_param)
    "none": ("none", "none"),
    "optimizer -> CPU": ("cpu", "none"),
    "optimizer -> NVMe": ("nvme", "none"),
    "optimizer + params -> CPU": ("cpu", "cpu"),
    "optimizer + params -> NVMe": ("nvme", "nvme"),
}


def _b(n: float) -> str:
    return f"{float(n):>16,.0f} B {float(n) / GB:>10.3f} GB"


def calculator_text(psi: float, world_size: int, stage: int, precision: str = "bf16",
                    offload_optimizer: str = "none", offload_param: str = "none", grad_accum: int = 1,
                    optimizer: str = "adam") -> str:
    """Bytes per rank by tier and category, and bytes each rank sends per step, from zeroedu.theory."""
    try:
        psi, world_size, stage, grad_accum = int(round(psi)), int(world_size), int(stage), int(grad_accum)
        tiers = theory.offload_bytes(psi, world_size, stage, precision, offload_optimizer, offload_param,
                                     optimizer=optimizer)
        comm = theory.comm_bytes_per_step(psi, world_size, stage, precision, grad_accum)
        moved = (theory.offload_transfer_bytes_per_step(psi, world_size, stage, precision, offload_optimizer,
                                                        offload_param, grad_accum, optimizer=optimizer)
                 if offload_optimizer != "none" or offload_param != "none" else None)
    except ValueError as e:
        return f"error: {e}"
    k = theory.optimizer_K(precision, optimizer)
    lines = [f"psi = {psi:,} parameters, N = {world_size}, stage {stage}, {precision}, {optimizer} "
             f"(K = {k} bytes/param), gradient accumulation {grad_accum}",
             "", "model states per rank (1 GB = 1e9 bytes):"]
    for tier, cats in tiers.items():
        if cats["total"] or tier == "device":
            for cat in (*theory.MODEL_STATES, "total"):
                lines.append(f"  {tier:<7} {cat:<16}{_b(cats[cat])}")
    if offload_optimizer == "none" and offload_param == "none":
        paper = theory.model_state_bytes_paper(psi, world_size, stage, K=k) if precision != "fp32" else None
        if paper is not None:
            lines.append(f"  paper formula (unpadded, 2+2+K bytes/param):{_b(paper)}")
    lines += ["", "bytes each rank sends per step (ring collectives, compute dtype):"]
    for key, v in comm.items():
        lines.append(f"  {key:<24}{_b(v)}")
    units, p = theory.comm_volume_paper(stage), theory.param_bytes(precision)
    lines.append(f"  paper: {units} psi x {p} bytes = {units * psi * p / GB:.3f} GB (large-N limit of the ring)")
    if moved:
        lines += ["", "offload traffic per step:"]
        lines += [f"  {key:<28}{_b(v)}" for key, v in moved.items()]
    return "\n".join(lines)


def planner_text(**kwargs) -> str:
    """zeroedu.planner.format_plan(plan(**kwargs)), or the error."""
    try:
        return planner.format_plan(planner.plan(**kwargs))
    except ValueError as e:
        return f"error: {e}"


class Calculator:
    """Controls, an output, and the text function that joins them. Displays as its VBox."""

    def __init__(self, controls: dict[str, widgets.ValueWidget], render: Callable[..., str],
                 convert: Callable[[dict], dict] | None = None) -> None:
        self.controls, self.render, self.convert = controls, render, convert or (lambda kw: kw)
        self.output = widgets.HTML()
        self.text = ""
        self.widget = widgets.VBox([widgets.HBox(list(controls.values())[i:i + 3])
                                    for i in range(0, len(controls), 3)] + [self.output])
        for c in controls.values():
            c.observe(self.update, names="value")
        self.update()

    def values(self) -> dict:
        return self.convert({name: c.value for name, c in self.controls.items()})

    def update(self, _change=None) -> None:
        self.text = self.render(**self.values())
        self.output.value = f"<pre style='font-size: 12px; line-height: 1.3'>{html.escape(self.text)}</pre>"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _style() -> dict:
    return {"style": {"description_width": "initial"}}


def memory_calculator(psi: float = 7.5e9, world_size: int = 64, stage: int = 3, precision: str = "bf16",
                      offload: str = "none", grad_accum: int = 1) -> Calculator:
    """Model size (billions), N, stage, precision, offload -> bytes per rank and comm per step."""
    controls = {
        "billions": widgets.BoundedFloatText(value=psi / 1e9, min=1e-9, max=1e5, step=0.1,
                                             description="parameters (billions)", **_style()),
        "world_size": widgets.BoundedIntText(value=world_size, min=1, max=1_000_000, description="N (ranks)",
                                             **_style()),
        # a slider: drag it from 0 to 3 and watch each stage shard one more model state
        "stage": widgets.IntSlider(value=stage, min=min(theory.STAGES), max=max(theory.STAGES),
                                   description="ZeRO stage", **_style()),
        "precision": widgets.Dropdown(options=list(theory.PRECISIONS), value=precision, description="precision",
                                      **_style()),
        "offload": widgets.Dropdown(options=list(OFFLOADS), value=offload, description="offload", **_style()),
        "grad_accum": widgets.BoundedIntText(value=grad_accum, min=1, max=100_000, description="grad accumulation",
                                             **_style()),
    }

    def convert(kw: dict) -> dict:
        oo, op = OFFLOADS[kw.pop("offload")]
        return {"psi": kw.pop("billions") * 1e9, **kw, "offload_optimizer": oo, "offload_param": op}

    return Calculator(controls, calculator_text, convert)


def planner_widget(model: str = "7B", gpus: int = 8, gpus_per_node: int = 8, gpu_memory_gb: float = 80.0,
                   intra: str | planner.Link = planner.INTRA_DEFAULT, inter: str | planner.Link = planner.INTER_DEFAULT,
                   precision: str = "bf16", micro_batch: int = 1, seq_len: int = 2048) -> Calculator:
    """zeroedu.planner.plan over presets and cluster settings; shows format_plan's table.

    intra / inter: a link name from planner.LINKS, or a Link (e.g. planner.calibrate(...) of collectives timed
    on your cluster), which joins the link menus under its name."""
    links = [(name, name) for name in sorted(planner.LINKS)]
    links += [(lk.name, lk) for lk in {id(x): x for x in (intra, inter) if isinstance(x, planner.Link)}.values()]
    controls = {
        "model": widgets.Dropdown(options=list(planner.PRESETS), value=model, description="model", **_style()),
        "gpus": widgets.BoundedIntText(value=gpus, min=1, max=1_000_000, description="GPUs", **_style()),
        "gpus_per_node": widgets.BoundedIntText(value=gpus_per_node, min=1, max=1024, description="GPUs per node",
                                                **_style()),
        "gpu_memory_gb": widgets.BoundedFloatText(value=gpu_memory_gb, min=1, max=10_000, description="GPU GB",
                                                  **_style()),
        "intra": widgets.Dropdown(options=links, value=intra, description="intra-node", **_style()),
        "inter": widgets.Dropdown(options=links, value=inter, description="inter-node", **_style()),
        "precision": widgets.Dropdown(options=list(theory.PRECISIONS), value=precision, description="precision",
                                      **_style()),
        "micro_batch": widgets.BoundedIntText(value=micro_batch, min=1, max=100_000, description="micro-batch",
                                              **_style()),
        "seq_len": widgets.BoundedIntText(value=seq_len, min=1, max=10_000_000, description="sequence",
                                          **_style()),
    }
    return Calculator(controls, planner_text)
