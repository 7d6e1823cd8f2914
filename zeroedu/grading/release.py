"""`zeroedu build-exercises --release DIR`: the folder a learner is given, with the exercises and nothing that
answers them.

In the course's own clone the solutions sit beside the exercises (the grader reads them), so in a workshop anyone
can open them. A release is built fresh from solutions/ (not copied
from exercises/, which may be stale) into DIR/exercises/: every answer region becomes its stub, hidden test cells
are removed (placeholders included), outputs and execution data are cleared, and the metadata that only the grader
needs goes too (the notebook's `zeroedu` block with its source path and grader setup, every nbgrader checksum).
nbgrader's grade_ids and points stay: they are how `zeroedu grade` matches a handed-in notebook to its solution.
The instructor keeps solutions/ and grades with it.
"""

from __future__ import annotations

from pathlib import Path

from zeroedu.grading import notebook as nbtools

README = """# Exercises · 练习

Open each notebook in JupyterLab, replace every `raise NotImplementedError(...)` with your code, and run the check
cells under it: each prints `✓ name (points)` or `✗ name (0/points): hint`. Your instructor grades the notebooks
you hand in with `zeroedu grade`, which also runs hidden tests (other sizes, rank counts and dtypes): write the
general solution, not one that fits the examples.

在 JupyterLab 中打开每个 notebook，把每个 `raise NotImplementedError(...)` 换成你的代码，然后运行下面的检查单元：
每个检查打印 `✓ 名称 (得分)` 或 `✗ 名称 (0/得分): 提示`。你提交的 notebook 由讲师用 `zeroedu grade` 评分，评分时还会运行
隐藏测试（其他的规模、rank 数和 dtype）：请写通用的解法，而不是只适配示例的解法。
"""


def _strip(nb) -> None:
    """Metadata only the grader needs (the notebook's zeroedu block, every nbgrader checksum), and the cells left
    where a hidden test was: their names and points say what is tested. The grader puts deleted test cells back
    from the solution (assembly.py), so a release notebook grades like the course's own exercise."""
    nb.metadata.pop("zeroedu", None)
    nb.cells = [c for c in nb.cells if c.source.strip() != nbtools.HIDDEN_PLACEHOLDER.strip()]
    for cell in nb.cells:
        cell.metadata.get("nbgrader", {}).pop("checksum", None)


def release(solutions: Path, out: Path) -> list[Path]:
    """Write the learner's release into `out` (which must not exist, or be empty); return the files written."""
    solutions, out = solutions.resolve(), out.resolve()
    if out == solutions or solutions in out.parents or out in solutions.parents:
        raise ValueError(f"--release {out}: the release must be outside the solutions folder {solutions} and not "
                         "contain it: give a new folder, e.g. --release /tmp/zeroedu-release")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--release {out}: the folder exists and is not empty; give a new folder (a release "
                         "is written whole, so that nothing from an earlier build is left in it)")
    sources = sorted(solutions.glob("*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no solution notebooks (*.ipynb) in {solutions}")
    exercises = []
    for src in sources:            # what build.build writes, then stripped; all checked before anything is written
        nb = nbtools.read(src)
        nbtools.validate(nb, src.name)
        exercise = nbtools.to_exercise(nb, f"{solutions.name}/{src.name}")
        _strip(exercise)
        exercises.append((src.name, nbtools.write_text(exercise)))
    (out / "exercises").mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in exercises:
        (out / "exercises" / name).write_text(text, encoding="utf-8")
        written.append(out / "exercises" / name)
    (out / "README.md").write_text(README, encoding="utf-8")
    return [*written, out / "README.md"]
