# ruff: noqa: E501  -- 中文 answers: ruff counts a CJK character as two columns
"""Exercise 10: the learner writes the spoken correction of each claim; the grader reads the sentences (never runs
them) and grades the verdict, the numbers and the terms against closed forms, with a hint per misconception."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from test_grading import EXERCISES, SOLUTIONS, _points, _sandboxed_or_trusted

from zeroedu import theory
from zeroedu.grading import ex10, grader, tr

EXERCISE = "ex10_spot_the_errors"


def _cell(nb, gid: str):
    return next(c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == gid)


def _solution() -> nbformat.NotebookNode:
    return nbformat.read(SOLUTIONS / f"{EXERCISE}.ipynb", as_version=4)


def _hidden_rubric() -> list[ex10.Expect]:
    """RUBRIC_B as the solution's hidden cell writes it (nowhere else)."""
    space: dict = {"ex10": ex10, "check": lambda *a: None, "tr": tr, "ANSWERS": None}   # what the setup cell binds
    exec(_cell(_solution(), "ex10-hidden-answers").source, space)
    return space["RUBRIC_B"]


def _solution_answers() -> dict[str, str]:
    space: dict = {}
    exec(_cell(_solution(), "ex10-answers").source, space)
    return space["ANSWERS"]


def test_rubric_numbers_are_the_papers():
    by_id = {r.id: r for r in [*ex10.RUBRIC, *_hidden_rubric()]}
    # ZeRO: stage 3 sends 3Ψ against DDP's 2Ψ
    assert by_id["A1"].numbers == (1.5,)
    # 2Ψ + 14Ψ/N for 13B on 16 GPUs, by hand: 26 + 11.375 GB; and zeroedu.theory agrees
    assert by_id["A2"].numbers[0] == pytest.approx(37.375)
    assert theory.model_state_bytes_paper(13e9, 16, 2) / theory.GB == pytest.approx(37.375)
    # offload: 4Ψ/N for 7B on 8 GPUs (paper), 6Ψ/N where DeepSpeed casts gradients to fp32
    assert by_id["A4"].numbers == (3.5, 5.25)
    assert theory.offload_transfer_bytes_per_step(7 * 10**9, 8, 2, offload_optimizer="cpu")["host_device"] == 3.5e9
    # ZeRO++: 3Ψ -> 0.75Ψ; hpZ 2Ψ/g for 70B in nodes of 8
    assert theory.zeropp_volume_paper(True, True, True) == 0.75 and 0.25 in by_id["A5"].numbers
    assert by_id["A6"].numbers == (17.5,) and 2 * 70e9 / 8 / 1e9 == 17.5
    assert [r.verdict for r in by_id.values()] == ["wrong", "wrong", "right", "wrong", "right", "wrong"]


@pytest.mark.parametrize("sentence, verdict, said, rejected", [
    ("错。是 1.5 倍，不是 2 倍。", "wrong", [1.5], [2.0]),
    ("Wrong: 1.5x, not 2x.", "wrong", [1.5], [2.0]),
    ("对，ZeRO-3 的 3Ψ 对 DDP 的 2Ψ", "right", [3.0, 2.0], []),
    ("right - 13B on 16 GPUs at stage 2: 37.4 GB", "right", [16.0, 37.4], []),
    ("错，是 1/4，翻倍不对", "wrong", [0.25], [2.0]),
    ("部分对：hpZ costs 2Ψ/g", "partly", [2.0], []),
])
def test_extract_reads_verdicts_numbers_and_negations(sentence, verdict, said, rejected):
    p = ex10.extract(sentence)
    assert (p.verdict, p.said, p.rejected) == (verdict, said, rejected)


def test_the_solutions_answers_pass_in_both_languages():
    answers = _solution_answers()
    ex10.check_answers(answers, ex10.RUBRIC)
    ex10.check_answers(answers, _hidden_rubric())
    langs = {k: bool(ex10.re.search(r"[\u4e00-\u9fff]", v)) for k, v in answers.items()}
    assert any(langs.values()) and not all(langs.values())


# (claim, a wrong answer, the words of the hint it must get)
MISCONCEPTIONS = [
    ("A1", "错，ZeRO-3 通信量是 DDP 的 3 倍：三次集合通信，前向反向都 all-gather。", "3× counts collectives, not bytes"),
    ("A1", "对，前向、反向各 all-gather 一次，通信量翻倍。", "2× is the sheet's error; stage 3 sends 1.5× DDP"),
    ("A1", "Right, stage 3 sends 2x DDP: two all-gathers.", "2× is the sheet's error"),
    ("A2", "对，16Ψ/N，约 13 GB。", "13 GB is 16Ψ/N, stage 3's formula"),
    ("A2", "Wrong: 4Ψ + 12Ψ/N = 61.75 GB per GPU.", "that is stage 1's 4Ψ + 12Ψ/N"),
    ("A3", "错，累积 8 步就是 8 倍通信。", "accumulation does not multiply its bytes"),
    ("A4", "Wrong: only the gradient shard goes down over PCIe, 1.75 GB.", "one direction only"),
    ("A4", "对，fp32 来回，PCIe 每卡 7 GB。", "7 GB moves fp32 both ways"),
    ("A6", "对，hpZ 不占显存，是 0 GB 的副本开销。", "hpZ keeps a secondary copy"),
    ("A6", "错，hpZ 的二级副本每卡 8.75 GB。", "that is Ψ/g"),
]


@pytest.mark.parametrize("claim, answer, hint", MISCONCEPTIONS)
def test_each_wrong_answer_gets_the_hint_for_its_misconception(claim, answer, hint):
    rubric = {r.id: r for r in [*ex10.RUBRIC, *_hidden_rubric()]}[claim]
    problems = ex10.grade_answer(answer, rubric)
    assert problems and any(hint in p for p in problems), problems
    answers = {**_solution_answers(), claim: answer}
    with pytest.raises(AssertionError, match=rf"{claim}: .*{ex10.re.escape(hint)}"):
        ex10.check_answers(answers, ex10.RUBRIC if claim in {"A1", "A2", "A3"} else _hidden_rubric())


def test_generic_problems_are_named():
    r = ex10.RUBRIC[1]
    assert ex10.grade_answer("", r) == ["no answer: write one sentence, 对/错 (right/wrong) first, with the number"]
    assert "start with the verdict" in ex10.grade_answer("ZeRO-2 keeps 37.4 GB", r)[0]
    assert ex10.grade_answer("错，大约 50 GB", r) == ["say the number: stage 2's model-state GB per GPU"]
    assert "in a clause that says 不是/not" in ex10.grade_answer("错，不是 37.4 GB", r)[0]
    assert "name the mechanism" in ex10.grade_answer("错，1.5 倍", ex10.RUBRIC[0])[0]


def test_answers_are_read_from_the_notebook_source_never_run(tmp_path):
    nb = nbformat.read(EXERCISES / f"{EXERCISE}.ipynb", as_version=4)
    with pytest.raises(NotImplementedError, match="ANSWERS: a dict from claim id"):
        ex10.answers_in_notebook(nb)                     # the stub
    victim = tmp_path / "ran"
    _cell(nb, "ex10-answers").source = f'open({str(victim)!r}, "w").write("x")\nANSWERS = {{"A1": "错，1.5 倍"}}\n'
    assert ex10.answers_in_notebook(nb) == {"A1": "错，1.5 倍"} and not victim.exists()
    _cell(nb, "ex10-answers").source = 'n = 1.5\nANSWERS = {"A1": f"错，{n} 倍"}\n'
    with pytest.raises(AssertionError, match="plain strings"):
        ex10.answers_in_notebook(nb)


def test_the_hidden_rubric_is_in_no_module_the_kernel_can_import():
    assert {r.id for r in ex10.RUBRIC} == {"A1", "A2", "A3"}
    package = Path(ex10.__file__).resolve().parents[1]
    sources = "\n".join(p.read_text(encoding="utf-8") for p in package.rglob("*.py"))
    exercise = (EXERCISES / f"{EXERCISE}.ipynb").read_text(encoding="utf-8")
    for r in _hidden_rubric():
        for _, pair in r.mistakes:
            for hint in (pair if isinstance(pair, tuple) else (pair,)):   # English and 中文
                assert hint not in sources and hint[:40] not in exercise, r.id


def _submission(tmp_path: Path, answers: str) -> Path:
    nb = nbformat.read(EXERCISES / f"{EXERCISE}.ipynb", as_version=4)
    _cell(nb, "ex10-answers").source = answers
    path = tmp_path / "learner" / f"{EXERCISE}.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


@pytest.mark.timeout(400)
def test_graded_solution_full_stub_zero_and_wrong_answers_get_their_hints(tmp_path):
    want = _points(EXERCISE)
    limits, opts = grader.Limits(cell_timeout=60), _sandboxed_or_trusted()
    [solved] = grader.grade([SOLUTIONS / f"{EXERCISE}.ipynb"], SOLUTIONS, limits, progress=False, options=opts)
    assert {t.grade_id: t.points for t in solved.tests} == want, [(t.grade_id, t.message) for t in solved.tests]
    assert solved.points == sum(want.values()) and any(t.hidden for t in solved.tests)
    [stub] = grader.grade([EXERCISES / f"{EXERCISE}.ipynb"], SOLUTIONS, limits, progress=False, options=opts)
    assert stub.points == 0 and {t.grade_id for t in stub.tests} == set(want)
    assert all(t.message.startswith("not implemented yet: ANSWERS") for t in stub.tests), [t.message for t in stub.tests]
    wrong = dict(_solution_answers(), A1="对，前向、反向各 all-gather 一次，通信量翻倍。", A6="对，hpZ 不占显存，0 GB。")
    path = _submission(tmp_path, "ANSWERS = " + repr(wrong) + "\n")
    [r] = grader.grade([path], SOLUTIONS, limits, progress=False, options=opts)
    tests = {t.grade_id: t for t in r.tests}
    assert "2× is the sheet's error; stage 3 sends 1.5× DDP" in tests["ex10-test-answers"].message
    assert "hpZ keeps a secondary copy" in tests["ex10-hidden-answers"].message
    assert r.points == 0
