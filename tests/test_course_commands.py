"""The commands the course prints work as printed from a notebook cell, with no venv activated: no notebook prints
a bare `zeroedu CMD` (on PATH only in an activated venv), and the printed forms run in a real kernel whose PATH has
no zeroedu command on it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

from zeroedu.course import selfgrade

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("course_commands", ROOT / "scripts" / "course_commands.py")
course_commands = importlib.util.module_from_spec(spec)
spec.loader.exec_module(course_commands)

# a command as a learner would type it in a terminal: only works where the venv is activated
BARE = re.compile(r"`(?:\.venv/bin/)?zeroedu (?:grade|doctor|tour|progress|bench|plan|build-exercises|consolidate)\b"
                  r"|```bash\s*\nzeroedu ")


def test_no_notebook_prints_a_bare_command():
    bad = []
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in course_commands.PENDING:
                continue
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
                if cell["cell_type"] == "markdown":
                    bad += [f"{rel}: {m.group(0)!r}" for m in BARE.finditer("".join(cell["source"]))]
    assert bad == [], "run python scripts/course_commands.py, then make exercises:\n" + "\n".join(bad)
    assert course_commands.rewrite("see `zeroedu doctor --json`") == "see `!{sys.executable} -m zeroedu doctor --json`"
    once = course_commands.rewrite("Self-grade: `zeroedu grade exercises/ex02_ring_collectives.ipynb`.")
    assert once == 'Self-grade: `zeroedu.grade("ex02_ring_collectives")` in a cell.'
    assert course_commands.rewrite(once) == once


def test_exercise_names_resolve_from_a_lessons_folder(monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")          # where a lesson's kernel runs
    assert selfgrade.resolve("ex01_memory_formulas").resolve() == ROOT / "exercises" / "ex01_memory_formulas.ipynb"
    assert not selfgrade.resolve("ex99_nothing").exists()
    monkeypatch.chdir(ROOT / "exercises")
    found = selfgrade.resolve("ex01_memory_formulas.ipynb").resolve()
    assert found == ROOT / "exercises" / "ex01_memory_formulas.ipynb"


@pytest.mark.timeout(300)
def test_printed_forms_run_in_a_kernel_without_an_activated_venv(tmp_path):
    """A kernel started with a PATH holding no `zeroedu` command (as from an IDE or a plain `jupyter lab` outside
    the venv): `!{sys.executable} -m zeroedu ...` runs, as the notebooks print it."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import shutil; print('zeroedu on PATH:', shutil.which('zeroedu'))"),
        nbformat.v4.new_code_cell("import sys\n!{sys.executable} -m zeroedu progress " + str(ROOT)),
        nbformat.v4.new_code_cell("!{sys.executable} -m zeroedu doctor --help"),
    ])
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"
    env["PYTHONPATH"] = str(ROOT)
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)          # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                                ).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    text = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert text[0].strip() == "zeroedu on PATH: None", text[0]
    assert "lessons run" in text[1] and "kind 类型" in text[1], text[1]
    assert "usage: zeroedu doctor" in text[2], text[2]
