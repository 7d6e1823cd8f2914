"""Issue 28: the exercise harnesses' hints speak the notebook's language.

Every message a harness in zeroedu/grading/exercises/ gives a learner goes through `tr(en, zh)`: read from the
source (no English sentence is left outside a tr() but for the allow-list below, each with its reason) and seen by
calling a few harness checks on wrong inputs in 中文 and in English (no ranks, no kernels: milliseconds)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from test_kit_messages import _is_prose, _literal_text  # what counts as an English sentence, defined once

import zeroedu
from zeroedu.grading import grader, wire
from zeroedu.grading.exercises import (
    ddp_buckets,
    learner_code,
    memory,
    offload_step,
    qwz_quantize,
    ranks,
    ring,
    stage2_accumulation,
    stage3_gather,
    training,
)
from zeroedu.i18n import ENV

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")
SOURCES = sorted((ROOT / "zeroedu/grading/exercises").glob("*.py")) + [ROOT / "zeroedu/grading/ex10.py"]
SOLUTIONS = sorted((ROOT / "solutions").glob("ex*.ipynb"))
CALL_WRITTEN_OUT = re.compile(r": '\w+\( ")   # f"min_gpus({psi:g}, stage={stage}, ...)": a call, not a sentence

# Functions whose English literals are not messages to a learner.
ALLOWED_FUNCTIONS = {
    "table": "a results table the exercise notebooks print: numbers under code-like column names, not a hint",
    "events_text": "exercise 3's trace of one backward (gradient ready / all-reduce bucket): a display, not a hint",
    "bus_text": "exercise 7's list of copies per direction and dtype: a display, not a hint",
    "expect": "exercise 10's rubric constructor: its error is for whoever writes a rubric, not for a learner",
}
# Module constants that are not messages: regular expressions (the traceback's, exercise 10's sentence reader) and
# exercise 10's sheet of claims, which shows both languages side by side.
SKIPPED_CONSTANTS = {"_FRAME", "SHEET", "NUMBER", "NEGATION", "NAMES", "CLAUSE", "VERDICT"}
# English literals that are matched against text or name code, never shown as a sentence.
ALLOWED_LITERALS = {
    "^rank (\\d+) of (\\d+) raised ": "regex over the launcher's English message, rewritten into tr() text",
    "\n\nTraceback from rank": "where the launcher's message ends and its tracebacks begin",
    "site-packages": "a path filter: frames of installed libraries are not the learner's",
    "/lib/python3": "a path filter: frames of the standard library are not the learner's",
    "out of bounds": "matched in torch's error to add exercise 6's hint",
    "Stage0WithYourHooks": "a class name",
    "YOUR ANSWER": "matched in a learner's answer: the stub's placeholder",
    "all-gather": "a term an answer must name (exercise 10's rubric), in either language",
}


def _english_left(path: Path, source: str | None = None) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        # docstrings and the bare strings that document a constant
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        if isinstance(node, ast.JoinedStr):   # an f-string is judged whole, not part by part
            skip |= {id(v) for v in node.values}
        if isinstance(node, ast.FunctionDef) and node.name in ALLOWED_FUNCTIONS:
            skip |= {id(n) for n in ast.walk(node)}
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(getattr(t, "id", "") in SKIPPED_CONSTANTS for t in targets):
            skip |= {id(n) for n in ast.walk(node)}
        if (isinstance(node, ast.Tuple) and len(node.elts) == 2
                and all(isinstance(e, ast.Constant | ast.JoinedStr) for e in node.elts)
                and CJK.search(_literal_text(node.elts[1]))):   # ("English", "中文"), said later with tr(*pair)
            skip |= {id(n) for elt in node.elts for n in ast.walk(elt)}
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "tr" and not (
                len(node.args) == 1 and isinstance(node.args[0], ast.Starred)):
            assert len(node.args) == 2, f"{path.name}:{node.lineno}: {ast.unparse(node)[:100]}"
            zh = " ".join(_literal_text(n) for n in ast.walk(node.args[1]))
            en = " ".join(_literal_text(n) for n in ast.walk(node.args[0]))
            assert CJK.search(zh) or not _is_prose(en), f"{path.name}:{node.lineno}: no Chinese: {en[:80]}"
            # exercise 10 names the verdict words a learner may answer with (对/错, 不是), and quotes an answer
            # ("错。……"), in English too
            assert not CJK.search(re.sub(r'对 ?/ ?错|不是|"[^"]*"', "", en)), \
                f"{path.name}:{node.lineno}: Chinese in the English half"
            skip |= {id(n) for arg in node.args for n in ast.walk(arg)}
    return [f"{path.name}:{n.lineno}: {_literal_text(n)[:90]!r}" for n in ast.walk(tree)
            if id(n) not in skip and _is_prose(_literal_text(n)) and _literal_text(n) not in ALLOWED_LITERALS]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_harness_message_is_left_in_english_only(path):
    assert _english_left(path) == []


def _test_cells(path: Path) -> list[tuple[str, str]]:
    """(grade_id, source) of each test cell of a solution notebook."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return [(c.metadata["nbgrader"]["grade_id"], c.source) for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem[:4])
def test_every_check_name_and_hint_in_the_exercises_has_a_chinese_form(path):
    """The test cells are shared by both editions: each check()'s name is tr("English", "中文"), and every hint an
    assert or raise gives is inside a tr() (the same static reading as the harnesses')."""
    cells = _test_cells(path)
    assert cells
    for gid, source in cells:
        tree = ast.parse(source)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "check"]
        assert calls, gid
        for call in calls:
            name = call.args[0]
            assert isinstance(name, ast.Call) and getattr(name.func, "id", "") == "tr", f"{gid}: {ast.unparse(name)}"
            en, zh = (a.value for a in name.args)
            assert CJK.search(zh) and not CJK.search(en), gid
        left = [m for m in _english_left(path, source) if not CALL_WRITTEN_OUT.search(m)]
        assert left == [], gid


def _run_ex09(answers: dict) -> list[str]:
    """Exercise 9's test cells (no torch, no kernel) against the given answers, each failed check's line."""
    from zeroedu.grading import CheckFailed

    ns: dict = {}
    lines = []
    import nbformat

    nb = nbformat.read(ROOT / "solutions/ex09_choose_strategy.ipynb", as_version=4)
    for cell in nb.cells:
        info = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or info.get("grade_id") == "zeroedu-setup":
            continue
        try:
            exec(cell.source, ns)   # the notebook's own code, as its kernel runs it
        except CheckFailed as e:
            lines.append(e.line())
        if info.get("solution"):
            ns.update(answers)
    return lines


def test_exercise_checks_speak_the_notebooks_language(monkeypatch):
    """Wrong answers to exercise 9 (bytes that ignore N, a GPU count that is never the smallest): the same cells
    say the check names and hints in 中文 under zeroedu.lang("zh"), in English otherwise."""
    wrong = {"comm_bytes_per_rank": lambda *a, **k: 1.0, "min_gpus": lambda *a, **k: 3}
    monkeypatch.setenv(ENV, "en")
    english = _run_ex09(wrong)
    zeroedu.lang("zh")
    chinese = _run_ex09(wrong)
    assert len(english) == len(chinese) >= 4
    assert all(not CJK.search(line) for line in english), english
    assert all(CJK.search(line) for line in chinese), chinese
    assert english[0].startswith("✗ bytes one rank sends per step, stage by stage (0/1): stage 0, 1e9 bf16 parameters")
    assert chinese[0].startswith("✗ 逐个 stage：每个 rank 每步发送的字节数 (0/1): stage 0，1e9 个 bf16 参数、4 个 rank")
    assert any("已经放得下：返回最小的 N" in line for line in chinese)


def test_exercise_10_grades_in_the_learners_language(monkeypatch):
    from zeroedu.grading import ex10

    monkeypatch.setenv(ENV, "en")
    a1 = ex10.RUBRIC[0]
    assert ex10.grade_answer("错。是 2 倍。", a1)[0].startswith("2× is the sheet's error")
    assert ex10.grade_answer("", a1) == ["no answer: write one sentence, 对/错 (right/wrong) first, with the number"]
    zeroedu.lang("zh")
    assert ex10.grade_answer("错。是 2 倍。", a1)[0].startswith("2 倍正是原文的错误")
    assert ex10.grade_answer("对，2 倍", a1)[0] == "这条说法不是“对”：用闭式公式核对它的数字"
    assert ex10.grade_answer("错，差不多", a1)[0] == "写出数字：ZeRO-3 每步通信字节数是 DDP 的几倍"


def test_the_static_check_sees_an_english_only_message(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('def f(x):\n    raise AssertionError(f"returned {x}, not a tensor: return a tensor")\n')
    assert len(_english_left(bad)) == 1


def test_the_grader_notes_a_learner_reads_have_a_chinese_form():
    tree = ast.parse((ROOT / "zeroedu/grading/grader.py").read_text(encoding="utf-8"))
    english = [" ".join(_literal_text(n) for n in ast.walk(call.args[0])) for call in ast.walk(tree)
               if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "tr"]
    for note in ("cannot read", "matches no notebook in the solutions folder", "the rest of the output was dropped",
                 "the grader could not grade this notebook", "only the newest is graded"):
        assert any(note in text for text in english), note


def _whole_tensor_scale(x: torch.Tensor, block: int):
    s = x.abs().max() / 127
    return torch.round(x / s).to(torch.int8), torch.full((*x.shape[:-1], -(-x.shape[-1] // block)), float(s))


def _failures() -> list[str]:
    """A few harness checks on wrong inputs, each one's hint."""
    out = []

    def hint(f, *args):
        with pytest.raises((AssertionError, ValueError)) as e:
            f(*args)
        out.append(str(e.value))

    hint(qwz_quantize.check_block_scales, _whole_tensor_scale)
    hint(qwz_quantize.check_block_scales, lambda x, block: [x])
    out.append(ddp_buckets._overlap_problem([("backward", False), ("reduce", 0)], [[0]], 2))
    live = {"psi": 10, "world_size": 2, "precision": "bf16", "stages": {0: {"parameters": 20}}}
    hint(memory.check_against_engine, lambda *a: {"parameters": 3}, live)
    out.append(learner_code.not_your_own(5, ()))
    row = dict(got=torch.ones(2), want=torch.ones(2), numel=8, dtype="float32", average=False, own=torch.ones(2),
               total=torch.ones(8), sent=0, collectives=[])
    hint(ring.RingRun("reduce_scatter", "ring_reduce_scatter", 4, rows=[[row]]).check_bytes)
    case = training.Case("c0")
    hint(offload_step.OffloadRun("x", [case], ranks=[[{"calls": {}}]]).check_calls, 0)
    hint(stage3_gather.Stage3Run("x", [case], ranks=[[{"meter": {"fetch": 0, "release": 0}}]]).check_memory)
    ledger_run = stage2_accumulation.Stage2Run("x", [training.Case("z", engine="zeroedu")], ranks=[[{
        "layout": [{"params": [("w", 0, (2, 3))]}], "dtype": "float32", "stage": 2, "ledger": []}]])
    hint(stage2_accumulation.check_traffic_prediction, lambda *a: None, ledger_run)
    out.append(ranks.ring_hang_hint())
    out.append(wire.claim_problem(5, 4, "ring_reduce_scatter", "SendCounter"))
    return out


def test_harness_hints_speak_chinese_under_zeroedu_lang_zh(monkeypatch):
    monkeypatch.setenv(ENV, "en")
    zeroedu.lang("zh")
    hints = _failures()
    assert len(hints) == 11
    for text in hints:
        assert CJK.search(text), text
    assert "这是整个张量的 scale：每个块要有自己的 scale。" in hints[0]
    assert hints[2].startswith("桶 0 在第 0 次 backward 中（2 个微批次中的第 1 个）做了 all-reduce")
    assert "引擎在每个 rank 上实际持有 20 字节" in hints[3]
    assert "没有点对点发送任何字节" in hints[5]
    assert hints[10].endswith("这个测试记 0 分。")


def test_the_english_hints_are_unchanged(monkeypatch):
    monkeypatch.setenv(ENV, "en")
    hints = _failures()
    assert not any(CJK.search(text) for text in hints), hints
    assert hints[0].endswith(" That is the scale of the whole tensor: each block needs its own.")
    assert hints[1] == "quantize_blocks returned list; return a tuple (codes, scales) of two tensors"
    assert hints[2].startswith("bucket 0 was all-reduced in backward 0 (micro-step 1 of 2), which is not the last "
                               "micro-step")
    assert hints[3] == ("stage 0, Ψ=10, N=2, bf16: your parameters = 3, the engine holds 20 bytes of it on each "
                        "rank (engine.memory(): parameters).")
    assert hints[4] == "5 is not a class: write the class the template asks for"
    assert hints[5] == ("ring_reduce_scatter sent no bytes point-to-point on rank 0: use dist.isend and dist.irecv "
                        "(or dist.P2POp with dist.batch_isend_irecv).")


def test_grader_module_imports_tr():
    assert grader.tr is zeroedu.i18n.tr
