"""What the grader reads in a notebook's cells without running them (`ast` on the source, in the grader's process).

Which names a cell defines and uses; where each cell of an assembled notebook runs (places: in the kernel, in
the grader, or both), and the names the grader's own cells bind (grader_names); the answer cells it refuses to
run (forged_answers: an answer name bound without its template's def or class, or bound again); and notes for
learner classes that replace an engine method the exercise did not ask for (shadowed_engine_names).
"""

from __future__ import annotations

import ast
import threading
from typing import Any

from zeroedu.grading import notebook as nbtools
from zeroedu.i18n import tr

_PARSE = threading.Lock()


def _parse(source: str) -> ast.Module:
    """ast.parse, one thread at a time. The grader reads submissions on several threads, and CPython 3.11 keeps the
    AST constructor's recursion depth in one counter per interpreter: two parses at once can fail with
    "SystemError: AST constructor recursion depth mismatch" (seen in this project's CI; python/cpython#106905)."""
    with _PARSE:
        return ast.parse(source)


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _defined(source: str) -> set[str]:
    """Names a cell's top level binds (def, class, import, assignment, for)."""
    try:
        tree = _parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def _methods(source: str) -> set[str]:
    """Names defined inside the classes of a cell."""
    try:
        tree = _parse(source)
    except SyntaxError:
        return set()
    return {item.name for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}


def _loaded(source: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(_parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    except SyntaxError:
        return set()


def _shape(source: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """A cell's top-level def and class names ({name: "def"|"class"}) and each class's methods."""
    try:
        tree = _parse(source)
    except SyntaxError:
        return {}, {}
    kinds: dict[str, str] = {}
    methods: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kinds[node.name] = "def"
        elif isinstance(node, ast.ClassDef):
            kinds[node.name] = "class"
            methods[node.name] = {item.name for item in node.body
                                  if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return kinds, methods


def _module_bindings(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Every binding of a module-level name in a cell: at its top level (in if/for/with/try too), and through
    `global` inside functions."""
    out: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Global):
                out.extend((name, child) for name in child.names)
            if not top:
                visit(child, False)
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.append((child.name, child))
                visit(child, False)
            elif isinstance(child, ast.Lambda):
                visit(child, False)
            elif isinstance(child, ast.Import | ast.ImportFrom):
                out.extend(((a.asname or a.name).split(".")[0], child) for a in child.names)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
                out.append((child.id, child))
            elif isinstance(child, ast.NamedExpr) and isinstance(child.target, ast.Name):
                out.append((child.target.id, child))
                visit(child, True)
            else:
                visit(child, True)

    visit(tree, True)
    return out



def _by_grade_id(nb: Any) -> dict[str, Any]:
    return {gid: c for c in nb.cells if (gid := nbtools.nbgrader_meta(c).get("grade_id"))}



def forged_answers(nb: Any, solution: Any) -> dict[int, str]:
    """Cells of an assembled notebook that the grader refuses to run, and why. Checked here, on the source, so
    nothing in the kernel can talk the grader out of it:
    - an answer cell must define each function and class its template defines, with `def` or `class` (not
      `MyStage1 = Stage1`, not a partial of zeroedu's function), each class with every method of the template
      written in its own body;
    - no cell of the learner's may bind one of those names a second time (a later `MyStage1 = Stage1`, a
      `global` in a function)."""
    stubs = {gid: c for gid, c in _by_grade_id(nbtools.to_exercise(solution, "")).items()
             if nbtools.cell_info(c).role == "answer" and c.cell_type == "code"}
    asked = {gid: _shape(c.source) for gid, c in stubs.items()}
    owner = {name: gid for gid, (kinds, _) in asked.items() for name in kinds}
    seen: dict[str, str] = {}
    problems: dict[int, str] = {}
    for i, (cell, where) in enumerate(zip(nb.cells, places(nb), strict=True)):
        if where != "kernel" or cell.cell_type != "code":
            continue
        gid = cell.metadata.get("zeroedu_grade", {}).get("grade_id")
        try:
            tree = _parse(cell.source)
        except SyntaxError:
            continue   # it fails in the kernel, with Python's own message
        why: list[str] = []
        bindings = _module_bindings(tree)
        if gid in asked:
            kinds, methods = _shape(cell.source)
            bound = {name for name, _ in bindings}
            for name, kind in asked[gid][0].items():
                if name not in bound:
                    continue   # never defined: the tests say "not defined", with what this cell did instead
                if kinds.get(name) != kind:
                    why.append(tr(f"it must define {name} with a `{kind} {name}` statement, as the template does",
                                  f"它必须像模板那样用 `{kind} {name}` 语句定义 {name}"))
                elif kind == "class":
                    missing = sorted(asked[gid][1][name] - methods[name])
                    if missing:
                        listed = ", ".join(missing)
                        why.append(tr(f"class {name} must write {listed} in its own body (the methods this "
                                      "exercise asks for)",
                                      f"类 {name} 必须在自己的类体里写出 {listed}（本练习要求的方法）"))
        for name, node in bindings:
            if name not in owner:
                continue
            first = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and gid == owner[name] \
                and name not in seen
            if first:
                seen[name] = gid
            elif not any(name in w for w in why):
                line = getattr(node, "lineno", "?")
                why.append(tr(f"it binds {name} again (line {line}), which the answer cell '{owner[name]}' defines: "
                              "an answer name is defined once, by its answer cell",
                              f"它又绑定了一次 {name}（第 {line} 行），而 {name} 由答案单元格 '{owner[name]}' 定义："
                              "答案里的名字只能由它的答案单元格定义一次"))
        if why:
            what = tr(f"answer cell '{gid}'", f"答案单元格 '{gid}'") if gid in asked else tr("cell you added",
                                                                                           "你添加的单元格")
            problems[i] = tr(f"zeroedu grade refused to run this {what}: ", f"zeroedu grade 拒绝运行这个{what}：") \
                + tr("; ", "；").join(why) + tr(".", "。")
    return problems


def places(nb: Any) -> list[str]:
    """Where each cell of an assembled notebook runs when graded: "kernel" (the learner's answers and added
    cells), "both" (given set-up code the answers need: the cells before the first answer, and those defining
    names an answer uses, unless they use the learner's names), "grader" (tests and every other given cell: they
    run here, on proxies of the learner's objects), or "" (markdown)."""
    answers = set(nb.metadata.get("zeroedu_grade", {}).get("answer_names", []))
    roles = [nbtools.cell_info(c).role if c.metadata.get("zeroedu_grade", {}).get("grade_id") else
             ("free" if c.cell_type == "code" else "markdown") for c in nb.cells]
    first_answer = next((i for i, r in enumerate(roles) if r == "answer"), len(roles))
    needed = set().union(*(_loaded(c.source) for c, r in zip(nb.cells, roles, strict=True) if r == "answer"))
    out = []
    for i, (cell, role) in enumerate(zip(nb.cells, roles, strict=True)):
        if role == "markdown" or cell.cell_type != "code":
            out.append("")
        elif role == "test":
            out.append("grader")
        elif role == "locked":
            setup = i < first_answer or bool(_defined(cell.source) & needed)
            out.append("both" if setup and not _loaded(cell.source) & answers else "grader")
        else:
            out.append("kernel")
    return out


def grader_names(nb: Any) -> set[str]:
    """Names that the cells run by the grader bind: never looked up in the learner's kernel."""
    return set().union(*(_defined(c.source) for c, where in zip(nb.cells, places(nb), strict=True)
                         if where in ("grader", "both")))



def shadowed_engine_names(nb: Any, submission: Any) -> list[str]:
    """Notes for learner classes that define a name their zeroedu base class already has and the template
    did not ask for: such a helper silently replaces the engine's own."""
    asked = set(nb.metadata.get("zeroedu_grade", {}).get("answer_methods", []))
    notes = []
    for cell in submission.cells:
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = _parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, ast.Name | ast.Attribute)]
            engine = _engine_class(bases)
            if engine is None:
                continue
            for item in node.body:
                names = ([item.name] if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) else
                         [t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)])
                for method in names:
                    if method in asked or method.startswith("__"):
                        continue
                    if hasattr(engine, method):
                        notes.append(f"your class {node.name} defines {method!r}, which {engine.__name__} already "
                                     f"has: it replaces the engine's own {method!r} (not one of the methods this "
                                     "exercise asks for). Give your helper a name of its own.")
    return notes


def _engine_class(bases: list[str]) -> type | None:
    import zeroedu.engine.stages as stages

    for base in bases:
        cls = getattr(stages, base, None)
        if isinstance(cls, type):
            return cls
    return None
