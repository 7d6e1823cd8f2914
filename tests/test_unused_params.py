"""Parameters used on only some ranks (mixture-of-experts routing, a rank-dependent module) train as a single
process with the same routing does: a missing gradient counts as zero (DeepSpeed's rule at stages 1-3, DDP's
find_unused_parameters), and equal-size buckets are never swapped between ranks.

The probe behind issue 36 found stage 2 wrong by 0.02-0.055 after 1-3 steps: a rank whose expert got no gradient
reduced that expert's bucket after backward, while the other rank reduced it during backward, so two buckets of
equal size met each other's collective and gloo exchanged them without a word.

Stage 3 gathers a module's parameters when it runs, so routing needs the routed modules inside a leaf
(set_z3_leaf_modules, as in DeepSpeed); without one, zeroedu stops at the first gather where the ranks differ and
names the leaf to mark, where gloo used to swap equal-size units silently or abort on unequal ones.
"""

from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn

import zeroedu
from zeroedu.launch import LaunchError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR = 1e-2
STEPS = 4
WORLD = 2
MICRO = 3
EXPERT = 16 * 16 + 16   # one expert's parameters: the bucket size, so each expert is a bucket of its own


class Mixture(nn.Module):
    """Three equal-size experts, of which `route` picks one, and a module used only when `extra` is set (on rank 1:
    a rank-dependent module)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.extra = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, route: int, extra: bool) -> torch.Tensor:
        h = torch.relu(self.experts[route](h))
        return h + self.extra(h) if extra else h


class Routed(nn.Module):
    """A trunk, the mixture, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.mix = Mixture()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, route: int, extra: bool) -> torch.Tensor:
        return self.out(self.mix(torch.relu(self.inp(x)), route, extra))


def route(rank: int, step: int) -> int:
    """Rank 0 and rank 1 use different experts at every step; the third expert goes unused at some steps."""
    return (rank + step) % 3


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * MICRO, 8, generator=g), torch.randn(WORLD * MICRO, 4, generator=g)


def _train(rank: int, world_size: int, stage: int, leaf: bool | str = False,
           routing=None, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """leaf: True marks Mixture with set_z3_leaf_modules, "config" names it in zero_optimization.leaf_module."""
    engine = _routed_engine(stage, leaf)
    _run_steps(engine, rank, routing, steps)
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def _routed_engine(stage: int, leaf: bool | str = False):
    model = Routed()
    if leaf is True:
        zeroedu.zero.set_z3_leaf_modules(model, [Mixture])
    zero = {"stage": stage, "reduce_bucket_size": EXPERT, "stage3_param_persistence_threshold": 0}
    if leaf == "config":
        zero["leaf_module"] = {"classes": ["Mixture"]}
    engine, *_ = zeroedu.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": zero})
    return engine


def _run_steps(engine, rank: int, routing, steps: int, after_step=None) -> None:
    """`steps` optimizer steps on this rank's share of each batch; routing(rank, step) -> (expert, extra)."""
    routing = routing or (lambda rank, step: (route(rank, step), rank == 1))
    for step in range(steps):
        x, y = data(step)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        out = engine(x[mine], *routing(rank, step))
        engine.backward((out - y[mine]).square().mean())
        engine.step()
        if after_step is not None:
            after_step()


def reference() -> dict[str, torch.Tensor]:
    """One process, the same routing per rank's share of the batch; the loss is the mean of the ranks' losses (the
    engine averages gradients over ranks), and a parameter without a gradient steps with a zero one."""
    model = Routed()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        for rank in range(WORLD):
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            out = model(x[mine], route(rank, step), extra=rank == 1)
            losses.append((out - y[mine]).square().mean())
        opt.zero_grad(set_to_none=True)
        (sum(losses) / WORLD).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("stage,leaf", [(0, False), (1, False), (2, False), (3, True), (3, "config")])
def test_parameters_used_on_some_ranks_match_a_single_process(stage, leaf):
    """Stages 0-2 as they are; stage 3 with the routed modules in a leaf, marked by set_z3_leaf_modules or named in
    the config's zero_optimization.leaf_module, as in DeepSpeed."""
    ref = reference()
    results = zeroedu.launch(_train, WORLD, args=(stage, leaf), timeout=300)
    for rank, got in enumerate(results):
        assert got.keys() == ref.keys()
        for name in ref:
            err = (got[name] - ref[name]).abs().max().item()
            assert err < 1e-5, f"stage {stage}, rank {rank}, {name}: off by {err}"


def _same_expert_extra_on_rank_1(rank: int, step: int) -> tuple[int, bool]:
    return 0, rank == 1


# Stage 3 without a leaf: each module's parameters are gathered when it runs, so ranks that run different modules
# would gather different units in one collective. Equal sizes (two experts) were exchanged without a word, unequal
# ones (the extra module against the head) made gloo abort with its own text; zeroedu stops before that gather.
@pytest.mark.parametrize("routing,gather,mine,theirs", [
    (None, 2, "mix.experts.0 (272 elements)", "mix.experts.1 (272 elements)"),
    (_same_expert_extra_on_rank_1, 3, "out (68 elements)", "mix.extra (272 elements)"),
], ids=["equal sizes", "unequal sizes"])
def test_stage3_routing_without_a_leaf_is_named_before_the_gather(routing, gather, mine, theirs):
    with pytest.raises(LaunchError) as err:
        zeroedu.launch(_train, WORLD, args=(3, False, routing), timeout=300, hang_timeout=60)
    text = str(err.value)
    assert "raised RoutingDriftError: stage 3: the ranks were about to gather different parameters" in text, text
    # The first forward, the first gather where the ranks part; each rank's modules, what ran them, from which line.
    for rank, what in enumerate([mine, theirs]):
        line = rf"rank {rank}: gather #{gather}: {re.escape(what)} for the forward of \S+, called from " \
               r"test_unused_params\.py:\d+\n"
        assert re.search(line, text), text
    # The fix, with the class to mark: the innermost module with a forward that holds both.
    assert "zeroedu.zero.set_z3_leaf_modules(model, [Mixture])" in text, text
    assert "deepspeed.utils.set_z3_leaf_modules" in text
    assert "Is there a distributed collective mismatch" not in text   # gloo's abort text: never reached


def test_the_leaf_to_suggest_is_the_innermost_module_where_the_ranks_parted():
    from zeroedu.engine.stages.routing import leaf_suggestion

    model = Routed()

    def asked(module: str, *entered: str) -> dict:
        return {"modules": [module], "entered": ["the model", *entered]}
    # Two experts of the mixture: the mixture (its ModuleList runs no hooks).
    assert "[Mixture]" in leaf_suggestion(model, [asked("mix.experts.0", "inp", "mix.experts.0"),
                                                  asked("mix.experts.2", "inp", "mix.experts.2")])
    # One rank runs the mixture's extra module where the other has left the mixture for the head: the mixture.
    assert "[Mixture]" in leaf_suggestion(model, [asked("out", "inp", "mix.experts.0", "out"),
                                                  asked("mix.extra", "inp", "mix.experts.0", "mix.extra")])
    # No module but the model itself holds where they parted: say how to make one.
    assert "no common parent module other than the model itself" in leaf_suggestion(
        model, [asked("out", "inp", "out"), asked("mix.extra", "mix.extra")])


def test_leaf_classes_may_be_named_as_in_deepspeed():
    """DeepSpeed 0.19.8's set_z3_leaf_modules takes classes or their names (plain or module-qualified) and
    raise_if_not_found; the same calls mark the same modules here as there."""
    ds_set = pytest.importorskip("deepspeed.utils").set_z3_leaf_modules

    for classes in ([Mixture], ["Mixture"], [f"{Mixture.__module__}.Mixture"]):
        ours, theirs = Routed(), Routed()
        marked = zeroedu.zero.set_z3_leaf_modules(ours, classes)
        ds_set(theirs, classes)
        assert [n for n, m in ours.named_modules() if getattr(m, "_z3_leaf", False)] == ["mix"]
        assert [n for n, m in theirs.named_modules() if getattr(m, "_z3_leaf", False)] == ["mix"]
        assert marked == [ours.mix]
    assert zeroedu.zero.set_z3_leaf_modules(Routed(), ["Bilinear"], raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="no module of class Bilinear"):
        zeroedu.zero.set_z3_leaf_modules(Routed(), ["Bilinear"])
    with pytest.raises(TypeError, match="module classes or their names"):
        zeroedu.zero.set_z3_leaf_modules(Routed(), [3])


@pytest.mark.parametrize("entries", [
    None,                                                   # DeepSpeed's default classes: none in this model
    {"classes": ["Mixture"]},
    {"classes": "Mixture"},                                 # one string, as DeepSpeed's validator accepts
    {"classes": [f"{Mixture.__module__}.Mixture"]},
    {"names": ["mix.experts.1", "out"]},
    {"name_suffixes": ["extra"]},
    {"classes": ["Bilinear"], "names": ["nowhere"], "name_suffixes": ["zzz"]},   # matches nothing
])
def test_the_config_leaf_module_marks_what_deepspeeds_engine_marks(entries):
    """zero_optimization.leaf_module read by zeroedu's config and applied at initialize marks the modules that
    DeepSpeed 0.19.8's engine marks (apply_zero_leaf_module_config on its parsed DeepSpeedZeroLeafModuleConfig)."""
    ds_leaf = pytest.importorskip("deepspeed.utils.z3_leaf_module")
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig

    cfg = zeroedu.load_config({"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 3, **({"leaf_module": entries} if entries else {})}})
    ours, theirs = Routed(), Routed()
    marked, notes = zeroedu.zero.apply_leaf_module_config(ours, cfg.zero_optimization.leaf_module or {})
    ds_leaf.apply_zero_leaf_module_config(theirs, DeepSpeedZeroLeafModuleConfig(**(entries or {})))
    leaves = [[n for n, m in model.named_modules() if getattr(m, "_z3_leaf", False)] for model in (ours, theirs)]
    assert leaves[0] == leaves[1]
    assert sorted(id(m) for m in marked) == sorted(id(m) for m in ours.modules() if getattr(m, "_z3_leaf", False))
    if entries and "Bilinear" in entries.get("classes", []):
        assert leaves[0] == [] and len(notes) == 3, notes
        assert "'nowhere'" in notes[0] and "'zzz'" in notes[1] and "matched no module" in notes[2]
    else:
        assert notes == []


def test_a_malformed_leaf_module_is_refused_with_its_fields():
    for bad, words in [({"class": ["Mixture"]}, "no field 'class'"), ({"classes": [Mixture]}, "list of strings"),
                       (["Mixture"], "must be an object")]:
        with pytest.raises(zeroedu.ConfigError, match=words):
            zeroedu.load_config({"train_micro_batch_size_per_gpu": 1,
                                 "zero_optimization": {"stage": 3, "leaf_module": bad}})


# When stage 3 asks before each gather (zeroedu.engine.stages.routing): that message and its wait cost about 8 % of
# a TinyGPT step, so the ranks ask only until every rank is known to have run its first step's modules in order
# (three steps), and again for good once some rank's forward has left that order. Every gather's modules stay in
# the per-step check's record, so ranks that part later still stop, at the step where they parted.
def _asks_per_step(rank: int, world_size: int, routing, steps: int) -> dict:
    engine = _routed_engine(3)
    asked = [0]   # the routing check's count after each step
    _run_steps(engine, rank, routing, steps, after_step=lambda: asked.append(engine.units.routing.count))
    asks = [b - a for a, b in zip(asked[:-1], asked[1:], strict=True)]
    gathers = [len([e for e in engine.ledger.select(op="all_gather", kind="params") if e.step == s])
               for s in sorted({e.step for e in engine.ledger})]
    return {"asks": asks, "gathers": gathers, "master": {k: v.clone() for k, v in engine.master_state_dict().items()}}


def _in_order(rank: int, step: int) -> tuple[int, bool]:
    return 0, False


def _all_switch_at_step_5(rank: int, step: int) -> tuple[int, bool]:
    return (1 if step >= 4 else 0), False


def test_stage3_asks_before_gathers_only_while_routing_can_part_the_ranks():
    steps = 9
    (quiet, _), (switched, _) = (zeroedu.launch(_asks_per_step, WORLD, args=(r, steps), timeout=300)
                                 for r in (_in_order, _all_switch_at_step_5))
    # Modules always in order: one ask per gather in the first three steps (the ledger counts the gathers), then none.
    assert quiet["gathers"][:3] == quiet["asks"][:3] and min(quiet["gathers"]) > 0, quiet
    assert quiet["asks"][3:] == [0] * (steps - 3), quiet
    # Every rank switches expert at step 5: a new order, the same on every rank, so no error; the check at step 5
    # says so, every rank reads it by step 7, and from step 8 on the ranks ask before every gather again.
    assert switched["asks"][3:7] == [0] * 4 and switched["asks"][7:] == switched["gathers"][7:steps], switched
    ref, _ = zeroedu.launch(_train, WORLD, args=(0, False, _all_switch_at_step_5, steps), timeout=300)
    for name, value in ref.items():   # stage 0 equals one process (above); stage 3 here equals stage 0
        assert (switched["master"][name] - value).abs().max().item() < 1e-5, name


def _rank_1_switches_at_step_6(rank: int, step: int) -> tuple[int, bool]:
    return (1 if rank == 1 and step >= 5 else 0), False


def test_stage3_routing_that_parts_after_the_asks_stopped_is_named_at_its_step():
    """Equal-size experts, but once rank 1 leaves the recorded order it also stops prefetching, so the sizes of the
    next gathers differ and gloo aborts: the launcher names the step, each rank's gather and the leaf to mark."""
    with pytest.raises(LaunchError) as err:
        zeroedu.launch(_train, WORLD, args=(3, False, _rank_1_switches_at_step_6, 8), timeout=300, hang_timeout=60)
    text = str(err.value)
    assert "after 5 optimizer steps" in text, text
    assert re.search(r"rank 0 called stage-3 gather of \S+ from test_unused_params\.py:\d+; rank 1 called stage-3 "
                     r"gather of mix\.experts\.1 from", text), text
    assert "zeroedu.zero.set_z3_leaf_modules(model, [ThatClass])" in text, text
