"""zeroedu's imports. No import cycles among its modules, counting imports inside functions too (a function-level
import hides a cycle from Python at import time, not from a reader); the graph is built from the source with `ast`,
so those tests import nothing they check. And the old module paths (before the move into packages) still import,
as the very modules at the new paths, for everything the course and its tests write (zeroedu._aliases)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zeroedu"

# Cycles tolerated for now (each a set of modules); a cycle may shrink below a known one, never grow or appear
# anew. None is left: engine <- stages <- extras <- compose is one-way, and __version__ lives in zeroedu._version.
KNOWN_CYCLES: list[frozenset[str]] = []


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the zeroedu modules it imports anywhere in its source (top level or inside a function)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:  # `from pkg import submodule` imports the submodule, else pkg itself
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of mutually importing modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            component.add(v)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & component))}" for m in sorted(component))


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "zeroedu.launch" in graph["zeroedu.doctor"]  # doctor's check_ranks imports launch inside the function
    assert "zeroedu.sysinfo" in graph["zeroedu.launch"]


def test_no_import_cycles():
    graph = import_graph()
    new = [c for c in cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles: " + " | ".join(describe(c, graph) for c in new)


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []



# -- layers: a module imports its own layer and the ones below, never one above ----------------------------------

# Lowest first. Each entry is a module or a package with everything in it (the longest entry that names a module
# decides its layer; "zeroedu" is the package's __init__ alone). The lower layers know nothing of what is built on
# them: the comm layer does not know the launcher, which observes Comm through zeroedu.comm.observe. A new module
# must be placed here: a package entry covers it, a new module at the root needs a line.
LAYERS: list[list[str]] = [
    # words, closed forms, text: no torch
    ["zeroedu._version", "zeroedu._aliases", "zeroedu.fmt", "zeroedu.sysinfo", "zeroedu.theory", "zeroedu.compat",
     "zeroedu.i18n"],
    # the config and what it names; memory measurement
    ["zeroedu.ds_keys", "zeroedu.schedulers", "zeroedu.config", "zeroedu.client", "zeroedu.precision",
     "zeroedu.memory", "zeroedu.allocator"],
    ["zeroedu.comm"],                 # counted collectives, the ledger, the comm thread
    ["zeroedu.launch"],               # ranks from a cell, a script or torchrun; observes Comm
    # what the engine uses and what stands beside it
    ["zeroedu.zero", "zeroedu.activation_checkpointing", "zeroedu.checkpoint", "zeroedu.models"],
    ["zeroedu.engine"],               # the step, flat layout, the step report
    ["zeroedu.engine.stages"],        # one file a stage
    ["zeroedu.engine.extras"],        # ZeRO++ and offload, over a stage's hooks
    ["zeroedu.compose"],              # builds the engine class for a config
    # the users: the API, the course, benchmarks, the grader, the command line
    ["zeroedu", "zeroedu.course", "zeroedu.bench", "zeroedu.grading", "zeroedu.doctor", "zeroedu.cli",
     "zeroedu.__main__",
     # the Chinese edition's builder: it makes exercises/zh/ with the grader's own solution -> exercise function
     "zeroedu.i18n.notebooks", "zeroedu.i18n.__main__"],
]


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            matches = module == entry or (entry != "zeroedu" and module.startswith(entry + "."))
            if matches and len(entry) > best:
                best, found = len(entry), i
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"add these modules to LAYERS in tests/test_imports.py: {unplaced}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, targets in graph.items() for b in targets
                  if None not in (layer_of(a), layer_of(b)) and layer_of(b) > layer_of(a))


def test_no_upward_import():
    upward = upward_imports(import_graph())
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    assert layer_of("zeroedu.comm.thread") < layer_of("zeroedu.launch.status") < layer_of("zeroedu.engine.flat")
    assert layer_of("zeroedu.engine.stages.stage3") > layer_of("zeroedu.engine")
    assert layer_of("zeroedu") == len(LAYERS) - 1 and layer_of("zeroedu.theory.planner") == 0
    assert upward_imports({"zeroedu.comm": {"zeroedu.launch", "zeroedu.comm.ledger"},
                           "zeroedu.launch": {"zeroedu.comm"}}) == [
        "zeroedu.comm (layer 2) imports zeroedu.launch (layer 3)"]


# -- private names stay in their file ------------------------------------------------------------------------------

# A `_name` is its file's own business; a name another file imports is an interface and says so by being public.
# The grader's modules (zeroedu/grading/, another engineer's, being reorganized) still import these; the list may
# shrink, never grow.
KNOWN_PRIVATE_IMPORTS: set[str] = {
    "zeroedu.grading.assembly: zeroedu.grading.source._by_grade_id",
    "zeroedu.grading.assembly: zeroedu.grading.source._defined",
    "zeroedu.grading.assembly: zeroedu.grading.source._methods",
    "zeroedu.grading.assembly: zeroedu.grading.source._norm",
    "zeroedu.grading.exercises.ddp_buckets: zeroedu.grading.exercises.learner_code._itemsize",
    "zeroedu.grading.grader: zeroedu.grading.client._cut",
    "zeroedu.grading.grader: zeroedu.grading.runner._Runner",
    "zeroedu.grading.grader: zeroedu.grading.score._refusals",
    "zeroedu.grading.exercises.learner_code: zeroedu.grading.kernel._is_learner_class",
    "zeroedu.grading.exercises.offload_step: zeroedu.grading.exercises.learner_code._itemsize",
    "zeroedu.grading.exercises.qwz_quantize: zeroedu.grading.exercises.stage3_gather._gathers",
    "zeroedu.grading.runner: zeroedu.grading.client._Client",
    "zeroedu.grading.runner: zeroedu.grading.client._LogPipe",
    "zeroedu.grading.runner: zeroedu.grading.client._QUIET",
    "zeroedu.grading.runner: zeroedu.grading.client._cut",
    "zeroedu.grading.runner: zeroedu.grading.link._Captured",
    "zeroedu.grading.runner: zeroedu.grading.link._KernelLink",
    "zeroedu.grading.exercises.stage1_sharding: zeroedu.grading.exercises.learner_code._itemsize",
    "zeroedu.grading.exercises.stage1_sharding: zeroedu.grading.exercises.learner_code._learner_or",
    "zeroedu.grading.exercises.stage2_accumulation: zeroedu.grading.exercises.learner_code._itemsize",
    "zeroedu.grading.exercises.stage2_accumulation: zeroedu.grading.exercises.learner_code._learner_or",
    "zeroedu.grading.exercises.stage3_gather: zeroedu.grading.exercises.learner_code._learner_or",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(path: Path, name: str, mods: dict[str, Path]) -> set[str]:
    """`name: module._x` for each private name that module `name` (file `path`) takes from another zeroedu module:
    `from m import _x`, or `m._x` where m is a zeroedu module imported under that name."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}   # local name -> zeroedu module it is bound to
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "zeroedu":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in mods:
                    bound[alias.asname or alias.name] = full
                elif _is_private(alias.name) and node.module != name:
                    found.add(f"{name}: {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in mods and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and bound.get(node.value.id, name) != name):
            found.add(f"{name}: {bound[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_files():
    mods = modules()
    found = set().union(*(private_imports(path, name, mods) for name, path in mods.items()))
    new = sorted(found - KNOWN_PRIVATE_IMPORTS)
    assert not new, "private names used by another file (make them public):\n" + "\n".join(new)
    gone = sorted(KNOWN_PRIVATE_IMPORTS - found)
    assert not gone, f"fixed, so take them off KNOWN_PRIVATE_IMPORTS: {gone}"


def test_a_private_import_is_found(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from zeroedu.launch.status import _Slots\nimport zeroedu.comm.ledger as led\nled._x()\n"
                 "from zeroedu.comm import ledger\nledger._y\nfrom zeroedu.fmt import fmt_bytes\n")
    mods = {"zeroedu.comm.ledger": a, "zeroedu.fmt": a}
    assert private_imports(a, "zeroedu.a", mods) == {
        "zeroedu.a: zeroedu.launch.status._Slots", "zeroedu.a: zeroedu.comm.ledger._x",
        "zeroedu.a: zeroedu.comm.ledger._y"}

# -- old module paths (zeroedu._aliases) ---------------------------------------------------------------------------

REPO = PACKAGE.parent


def _run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (imports are cached per process, so each question needs its own)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_no_module_left_at_an_old_path():
    """The old paths are answered by the table, never by a stub file at the old place."""
    from zeroedu._aliases import OLD_TO_NEW
    stubs = [old for old in OLD_TO_NEW
             if (REPO / (old.replace(".", "/") + ".py")).exists() or (REPO / old.replace(".", "/")).is_dir()]
    assert not stubs, f"files at old paths: {stubs}"


def test_each_old_path_is_the_new_module_itself():
    """import old -> the very module object at the new path, loaded once from the new file; its own spec kept."""
    result = _run(textwrap.dedent("""
        import importlib, sys
        import zeroedu
        from zeroedu._aliases import OLD_TO_NEW
        for old, new in OLD_TO_NEW.items():
            a, b = importlib.import_module(old), importlib.import_module(new)
            assert a is b, (old, new)
            assert a.__name__ == new and a.__spec__.name == new, (old, a.__name__, a.__spec__.name)
            if old.count(".") == 1:   # zeroedu.viz after the import too (zeroedu.grading.X: an attribute of grading)
                assert getattr(zeroedu, old.split(".")[1]) is a, old
        files = {}
        for name, m in list(sys.modules.items()):
            f = getattr(m, "__file__", None)
            if name.startswith("zeroedu") and f:
                files.setdefault(f, set()).add(id(m))
        twice = [f for f, ids in files.items() if len(ids) > 1]
        assert not twice, f"loaded twice: {twice}"
        print("ok", len(OLD_TO_NEW))
    """))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_old_submodules_and_attribute_access():
    result = _run(textwrap.dedent("""
        import zeroedu
        import zeroedu.stages.stage2, zeroedu.engine.stages.stage2
        assert zeroedu.stages.stage2 is zeroedu.engine.stages.stage2
        assert zeroedu.stages.stage2.Stage2 is zeroedu.engine.stages.Stage2
        from zeroedu.offload.swap import SwapFile
        from zeroedu.engine.extras.offload.swap import SwapFile as NewSwapFile
        assert SwapFile is NewSwapFile and SwapFile.__module__ == "zeroedu.engine.extras.offload.swap"
        import zeroedu as z
        assert z.checkpointing is z.activation_checkpointing     # attribute access, no import statement
        assert z.flat.Bucket is z.engine.flat.Bucket
        print("ok")
    """))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_launch_is_the_package_and_the_function():
    """zeroedu.launch(fn, world_size) works whichever of its submodules was imported first, and the package's
    names stay reachable as zeroedu.launch.<name>."""
    result = _run(textwrap.dedent("""
        import zeroedu.launch.rank
        import zeroedu.launch.status as status
        import zeroedu
        from zeroedu import launch
        import cloudpickle, pickle
        def who(rank, world):
            return (rank, world)
        assert zeroedu.launch(who, world_size=2, backend="gloo") == [(0, 2), (1, 2)]
        assert launch is zeroedu.launch and zeroedu.launch.status is status and zeroedu.launch.LaunchError
        assert pickle.loads(cloudpickle.dumps(zeroedu.launch)) is zeroedu.launch
        print("ok")
    """))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_theory_loads_no_torch():
    """The closed forms, the planner and the shared words need no torch (`zeroedu plan` on a machine without it)."""
    result = _run("import sys, zeroedu.theory, zeroedu.theory.planner, zeroedu.planner, zeroedu.vocab; "
                  "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout


def _zeroedu_imports(source: str) -> set[str]:
    """The zeroedu import statements of a Python source, one normalized line each."""
    # Notebook cells may hold IPython lines (%magic, !shell); they are not Python.
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {f"import {a.name}" for a in node.names if a.name.split(".")[0] == "zeroedu"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "zeroedu":
            names = ", ".join(a.name for a in node.names if a.name != "*")
            if names:
                out.add(f"from {node.module} import {names}")
    return out


def users_imports() -> dict[str, set[str]]:
    """Every zeroedu import in the course and its tests: notebooks, solutions, exercises, tests, examples, scripts."""
    found: dict[str, set[str]] = {}
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((REPO / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            for cell in cells:
                if cell["cell_type"] == "code":
                    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                    for stmt in _zeroedu_imports(src):
                        found.setdefault(stmt, set()).add(path.name)
    for folder in ("tests", "examples", "scripts"):
        for path in sorted((REPO / folder).glob("*.py")):
            for stmt in _zeroedu_imports(path.read_text(encoding="utf-8")):
                found.setdefault(stmt, set()).add(path.name)
    return found


def test_every_import_the_course_uses_still_works():
    """Each `import zeroedu...` / `from zeroedu... import ...` written in a notebook, solution, exercise, test,
    example or script runs in a fresh interpreter (the old paths among them)."""
    found = users_imports()
    assert any(s.startswith("from zeroedu.stages") for s in found), sorted(found)   # the finder found the old paths
    script = textwrap.dedent("""
        import json, sys
        failed = {}
        for stmt in json.loads(sys.argv[1]):
            try:
                exec(stmt, {})
            except Exception as e:
                failed[stmt] = repr(e)
        # A module found outside this tree (another checkout's editable install answers a missing zeroedu.x
        # from its own folder) would hide a path that this tree no longer has.
        package = sys.argv[2]
        for name, module in sys.modules.items():
            where = getattr(module, "__file__", None) or package
            if name.split(".")[0] == "zeroedu" and not where.startswith(package):
                failed[name] = f"loaded from {module.__file__}, outside {package}"
        print(json.dumps(failed))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script, json.dumps(sorted(found)), str(PACKAGE)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{s}: {e} (in {sorted(found.get(s, []))})" for s, e in failed.items())


def test_no_code_names_a_module_by_its_old_path():
    """A module name written as a string in code (a prefix check on frames' __name__, an import_module argument)
    must be the new path: an import of an old path still works, a comparison with one silently stops matching."""
    from zeroedu._aliases import OLD_TO_NEW

    mods = modules()
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                s = node.value.split(":")[0]   # "module:Name", as the grader's blocks write them
                # a module name, not a message that mentions one (users may still type the old paths)
                if re.fullmatch(r"zeroedu(\.\w+)+", s) and s not in mods and name != "zeroedu._aliases" and any(
                        s == old or s.startswith(old + ".") or (old.startswith(s) and len(s) > len("zeroedu."))
                        for old in OLD_TO_NEW):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "old module paths in code:\n" + "\n".join(found)
