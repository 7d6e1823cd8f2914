"""The engine's extension points are public: the hooks a stage or an extra overrides are documented on Engine, and
the extras (offload, ZeRO++, checkpoints, zero.Init, the grader) touch no private name of Engine or a stage.

A private (`_name`) of a stage may change with the stage; an extra that reads it breaks silently. So this test
parses the code (no engine is built) and names each place an extra touches one.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from zeroedu.engine import Engine
from zeroedu.stages import Stage2, Stage3

ROOT = Path(__file__).resolve().parents[1] / "zeroedu"
CORE = [ROOT / "engine" / "__init__.py", *sorted((ROOT / "engine" / "stages").glob("*.py"))]
CHECKPOINT = sorted((ROOT / "checkpoint").glob("*.py"))   # zeroedu.checkpoint and its parts
OFFLOAD = sorted((ROOT / "engine" / "extras" / "offload").glob("*.py"))   # one mixin, OffloadMixin, of the parts
MIXINS = [*OFFLOAD, ROOT / "engine" / "extras" / "zeropp.py"]
EXTRAS = [*MIXINS, *CHECKPOINT, ROOT / "zero.py",
          *sorted((ROOT / "grading").rglob("*.py"))]

# The protocol: what a stage or an extra may override or call, with the class that documents it.
HOOKS = {
    Engine: ["setup", "make_layout", "place_parameters", "before_backward", "on_grad_ready", "reduce_bucket",
             "after_backward", "grad_out", "grad_pieces", "optimizer_step", "publish", "zero_grads", "owned",
             "overlap", "wait", "master_full", "checkpoint_master", "checkpoint_optimizer_state",
             "restore_checkpoint", "build_optimizer"],
    Stage2: ["take_bucket_slot", "take_bucket_buffer", "move_grads", "reduce_scatter_buckets"],
    Stage3: ["fetch", "release", "start_gathers", "unit_buffer", "param_piece", "param_home", "post_backward"],
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def core_privates(paths: list[Path] = CORE) -> set[str]:
    """`_names` that these files' classes define (Engine and the stages by default): methods, class attributes,
    and attributes set on self."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names |= {t.id for t in targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def touches(path: Path, privates: set[str]) -> list[str]:
    """Each line of `path` that reads, writes or overrides one of `privates`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in privates:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name in privates:
                    found.append(f"{path.relative_to(ROOT.parent)}:{item.lineno}: def {item.name}")
    return found


def test_the_core_has_privates_to_protect():
    assert {"_phase", "_tracker"} <= core_privates()   # the scan sees methods and attributes set on self
    assert {"_file_io", "_swap_out", "_param_pool"} <= core_privates(OFFLOAD)   # and every part of offload


@pytest.mark.parametrize("path", EXTRAS, ids=lambda p: str(p.relative_to(ROOT)))
def test_extras_touch_no_private_of_engine_or_stage(path):
    found = touches(path, core_privates())
    assert not found, ("an extra reaches into a private of Engine or a stage; use (or add) a documented hook:\n"
                       + "\n".join(found))


@pytest.mark.parametrize("path", [p for p in EXTRAS if p not in MIXINS], ids=lambda p: str(p.relative_to(ROOT)))
def test_grader_and_checkpoints_touch_no_private_of_an_extra(path):
    """Offload's and ZeRO++'s privates are theirs too: the grader and the checkpoint code use their public hooks."""
    found = touches(path, core_privates(MIXINS) - core_privates([path]))
    assert not found, "this module reaches into a private of offload or ZeRO++:\n" + "\n".join(found)


@pytest.mark.parametrize(("cls", "name"), [(c, n) for c, names in HOOKS.items() for n in names],
                         ids=lambda x: getattr(x, "__name__", x))
def test_each_hook_exists_and_says_its_contract(cls, name):
    hook = getattr(cls, name)
    assert callable(hook), f"{cls.__name__}.{name} is not a method"
    assert inspect.getdoc(hook), f"{cls.__name__}.{name} has no docstring saying its contract"


def test_engine_lists_the_protocol():
    doc = inspect.getdoc(Engine)
    missing = [n for names in HOOKS.values() for n in names if n not in doc]
    assert not missing, f"Engine's docstring does not list these hooks: {missing}"


def test_stages_never_import_extras():
    """Layering is one-way: extras build on stages, so a stage or the engine never imports an extra (even inside a
    function), and the class composition lives above both."""
    extras = {"zeroedu.engine.extras", "zeroedu.compose", "zeroedu.offload", "zeroedu.zeropp"}   # new and old paths
    for path in CORE:
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            bad = [m for m in mods if any(m == e or m.startswith(e + ".") for e in extras)]   # or a module inside one
            assert not bad, f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {bad}"


def test_no_stage_number_branches_in_extras():
    """Extras ask the class (its hooks and attributes), not `self.stage == k`."""
    for path in MIXINS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "stage":
                pytest.fail(f"{path.relative_to(ROOT.parent)}:{node.lineno} branches on the stage number")


def imports_of(path: Path) -> set[str]:
    """zeroedu modules that `path` imports, at the top or inside a function (`from zeroedu import x` -> zeroedu.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("zeroedu.")}


def test_no_import_cycle_through_the_engine_its_stages_or_extras():
    """engine <- stages <- offload, zeropp <- compose: following imports from any of them never comes back."""
    files = [*CORE, *MIXINS, *CHECKPOINT, ROOT / "zero.py", ROOT / "compose.py"]
    modules = {"zeroedu." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in files}
    graph = {m: (imports_of(p) & modules.keys()) - {m} for m, p in modules.items()}   # a package may import its parts

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start] - seen:
            if nxt == goal or reaches(nxt, goal, seen | {nxt}):
                return True
        return False

    cyclic = sorted(m for m in graph if reaches(m, m, set()))
    assert not cyclic, f"these modules import themselves through others: {cyclic}"


def test_one_way_to_overlap():
    """Stages and extras reach the comm thread through engine.overlap(fn) (prefetch=True for a gather started
    ahead of need), never through comm.run_async directly: only the engine's overlap() calls it."""
    callers = [p.relative_to(ROOT).as_posix() for p in [*CORE, *EXTRAS] if "run_async(" in p.read_text()]
    assert callers == ["engine/__init__.py"], callers
