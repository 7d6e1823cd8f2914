"""Issue 28: `zeroedu grade` speaks each notebook's language. A Chinese-edition notebook (metadata
zeroedu.language = "zh", notebooks/zh/exercises/) gets its check names, hints and notes in 中文, an English one in
English, in the same run, two at a time (the grader grades in threads; the language is per thread). Real kernels,
the real CLI; exercise 9 (no torch in its kernel) keeps it to seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import zeroedu
from zeroedu.i18n import ENV, current, speaking

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")
EXERCISE = "ex09_choose_strategy"
WRONG = "def comm_bytes_per_rank(num_params, world_size, stage, precision='bf16'):\n    return 1.0\n"


def _hand_in(notebook: Path, folder: Path) -> None:
    """The notebook with the solution's answers, and a wrong comm_bytes_per_rank (it ignores N and the stage)."""
    solution = nbformat.read(ROOT / "solutions" / f"{EXERCISE}.ipynb", as_version=4)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell.source = WRONG if "def comm_bytes_per_rank" in answers[gid] else answers[gid]
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / f"{EXERCISE}.ipynb")


@pytest.mark.timeout(600)
def test_a_class_graded_at_once_gets_feedback_in_each_notebooks_language(tmp_path):
    subs = tmp_path / "subs"
    _hand_in(ROOT / "notebooks" / "zh" / "exercises" / f"{EXERCISE}.ipynb", subs / "wang")
    _hand_in(ROOT / "exercises" / f"{EXERCISE}.ipynb", subs / "smith")
    book = tmp_path / "gradebook.json"
    env = {k: v for k, v in os.environ.items() if k != ENV}   # the grader itself speaks English
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(subs), "--trusted", "--quiet",
                           "--jobs", "2", "--json", str(book)], capture_output=True, text=True, timeout=500,
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    graded = {e["learner"]: e for learner in json.loads(book.read_text())["learners"]
              for e in learner["exercises"]}
    wang, smith = graded["wang"], graded["smith"]
    assert (wang["language"], smith["language"]) == ("zh", "en")
    # the same wrong answer loses the same points in both languages
    assert wang["points"] == smith["points"] < wang["max_points"] == smith["max_points"]
    assert [t["passed"] for t in wang["tests"]] == [t["passed"] for t in smith["tests"]]
    for t in wang["tests"]:
        assert CJK.search(t["name"]), t
        assert t["passed"] or CJK.search(t["message"]), t
    for t in smith["tests"]:
        assert not CJK.search(t["name"] + t["message"]), t
    first = next(t for t in wang["tests"] if not t["passed"])
    assert first["name"] == "逐个 stage：每个 rank 每步发送的字节数"
    assert first["message"].startswith("stage 0，1e9 个 bf16 参数、4 个 rank：1 字节，应为 3e+09。")
    assert next(t for t in smith["tests"] if not t["passed"])["message"].startswith(
        "stage 0, 1e9 bf16 parameters on 4 ranks: 1 bytes, expected 3e+09.")


def test_speaking_is_per_thread_and_ends_with_its_block(monkeypatch):
    import threading

    monkeypatch.setenv(ENV, "en")
    seen = {}
    with speaking("zh"):
        other = threading.Thread(target=lambda: seen.setdefault("other thread", current()))
        other.start()
        other.join()
        seen["inside"] = current()
    seen["after"] = current()
    assert seen == {"other thread": "en", "inside": "zh", "after": "en"}
    zeroedu.lang("zh")   # the process's setting still applies outside a block
    with speaking("en"):
        assert current() == "en"
    assert current() == "zh"
    with pytest.raises(ValueError, match="the course speaks en and zh"):
        with speaking("fr"):
            pass


def test_the_graders_own_verdicts_speak_the_notebooks_language():
    """What the grader says about a cell that timed out, was killed, did not run or raised, and about code that
    calls the engine's own answer: 中文 inside speaking("zh"), the English wording outside."""
    from zeroedu.grading import kernel, remote
    from zeroedu.grading.results import CellRun
    from zeroedu.grading.score import _plain

    runs = [CellRun("timeout", evalue="30"), CellRun("killed", evalue="30"), CellRun("died", evalue="SIGKILL"),
            CellRun("not run"), CellRun("error", "NotImplementedError", ""), CellRun("error", "AssertionError", ""),
            CellRun("error", "NameError", "name 'f' is not defined")]

    def said() -> list[str]:
        out = [_plain(r) for r in runs]
        with pytest.raises(remote.KernelUnavailable) as e:
            remote.unplain([[[]]], depth=99)
        who = kernel.tr("your code (cell 3)", "你的代码（cell 3）")
        return [*out, str(e.value), kernel._message("Stage1.step", who)]

    with speaking("zh"):
        chinese = said()
    with speaking("en"):
        english = said()
    assert all(CJK.search(text) for text in chinese), chinese
    assert not any(CJK.search(text) for text in english), english
    assert chinese[0] == "运行超过 30 秒被中断：可能是死循环，或各 rank 互相等待（deadlock，死锁）"
    assert english[0].startswith("timed out after 30 s and was interrupted")
    assert english[6] == "name 'f' is not defined: run the cell that defines it first, and fix it if it fails"
    assert chinese[6] == "name 'f' is not defined：请先运行定义它的单元格；如果那个单元格报错，先把它修好"
    assert chinese[8].startswith("Stage1.step 是本练习要你自己写的部分")
