"""The grader's messages in 中文: check()'s own words and the ring exercise's diagnoses follow `zeroedu.lang` (the
ZEROEDU_LANG environment variable) through `tr()`. Read from the source (every English sentence of those
functions sits inside a tr() with a Chinese form) and seen in a real grading run in Chinese."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")

# file -> functions whose every message is translated (tests/test_harness_messages_zh.py checks all the harnesses)
TRANSLATED = {
    "zeroedu/grading/check.py": {"describe_exception"},
    "zeroedu/grading/exercises/ring.py": {"_check_row", "_diagnose", "_shifted"},
}


def _literal_text(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return " ".join(v.value for v in node.values if isinstance(v, ast.Constant))
    return ""


def _is_prose(text: str) -> bool:
    """Two English words or more, once code (name=value, dotted and snake_case names) is taken out."""
    text = re.sub(r"\w+=\w+|\w+(\.\w+)+|\w*_\w*", " ", text)
    return len(re.findall(r"[A-Za-z]{3,}", text)) >= 2


@pytest.mark.parametrize("path", list(TRANSLATED))
def test_every_message_of_the_translated_functions_has_a_chinese_form(path):
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in TRANSLATED[path]]
    assert {f.name for f in functions} == TRANSLATED[path]
    checked = 0
    for fn in functions:
        inside_tr: set[int] = set()
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "tr":
                assert len(call.args) == 2, ast.unparse(call)
                zh = " ".join(_literal_text(n) for n in ast.walk(call.args[1]))
                assert CJK.search(zh), ast.unparse(call)[:200]
                inside_tr |= {id(n) for arg in call.args for n in ast.walk(arg)}
        body = fn.body[1:] if ast.get_docstring(fn) else fn.body
        for stmt in body:
            for node in ast.walk(stmt):
                if _is_prose(_literal_text(node)):
                    checked += 1
                    assert id(node) in inside_tr, f"{path}:{node.lineno}: English only: {_literal_text(node)[:80]}"
    assert checked >= 4


def _check_line(lang: str) -> str:
    code = ("from zeroedu.grading import check, CheckFailed\n"
            "def f():\n    raise NotImplementedError('ring_all_gather')\n"
            "try:\n    check('all-gather', 2, f)\nexcept CheckFailed as e:\n    print(e.line())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZEROEDU_LANG": lang}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout


def test_check_speaks_the_notebooks_language():
    assert _check_line("en").strip() == "✗ all-gather (0/2): not implemented yet: ring_all_gather"
    assert _check_line("zh").strip() == "✗ all-gather (0/2): 尚未实现：ring_all_gather"


def test_a_chinese_grading_run_says_why_in_chinese_and_the_report_still_names_the_mistakes(wrong_answer_class_zh):
    """The wrong answers handed in on the Chinese exercise notebooks (conftest.wrong_answer_class_zh): the hints
    are the harness's Chinese sentences, and the Chinese report names the mistakes behind them."""
    tests = {(e["learner"], t["grade_id"]): t for (_, _), e in wrong_answer_class_zh.results.items()
             for t in e["tests"]}
    li, wang = "ex02_rs_no_average", "ex02_rs_off_by_one"
    assert "返回的是总和而不是平均值：average=True 时要除以 rank 数 N。" in tests[li, "ex02-test-rs-average"][
        "message"]
    assert "ring 的调度偏了 1 步" in tests[wang, "ex02-test-rs-sum"]["message"]
    assert "在 4 个 rank 中的 rank " in tests[wang, "ex02-test-rs-sum"]["message"]
    zh = wrong_answer_class_zh.report_zh
    assert "把各 rank 的梯度求和后没有除以 N" in zh and "ring 的起始块错了一步" in zh
