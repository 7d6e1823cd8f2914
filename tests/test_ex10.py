"""Exercise 10, spot the errors: the harness (zeroedu/grading/ex10.py) against the papers' own numbers, and
`zeroedu grade` end to end with real kernels: the solution scores full marks, the stub zero, and three wrong
answers lose exactly the points they should, each with a hint that names the mistake."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest
from test_grading import EXERCISES, SOLUTIONS, _by_id, _points, _sandboxed_or_trusted, make_submission

from zeroedu import theory
from zeroedu.grading import ex10, grader

EXERCISE = "ex10_spot_the_errors"


def _claim(kind: str, **params) -> ex10.Claim:
    return ex10.Claim("t", kind, params, 0.0, ex10.KINDS[kind][2], "", "")


def _hidden_sheet() -> list[ex10.Claim]:
    """The second sheet, as the solution's hidden test cell writes it (nowhere else: not importable)."""
    nb = nbformat.read(SOLUTIONS / f"{EXERCISE}.ipynb", as_version=4)
    cell = next(c for c in nb.cells
                if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "ex10-hidden-numbers")
    space: dict = {"ex10": ex10, "check": lambda *args: None, "correct": None}
    exec(cell.source, space)
    return space["SHEET_B"]


SHEET_B = _hidden_sheet()


def _solution_functions() -> dict:
    """`correct` and `is_true` as the solution notebook writes them, defined in a fresh namespace."""
    nb = nbformat.read(SOLUTIONS / f"{EXERCISE}.ipynb", as_version=4)
    space: dict = {"theory": theory, "Claim": ex10.Claim}
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            exec(cell.source, space)
    return space


# -- the harness, without kernels ------------------------------------------------------------------------------

def test_reference_gives_the_papers_numbers():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters on 64 GPUs
    fig1 = [ex10.reference(_claim("model_states", psi=7.5e9, n=64, stage=s)) for s in range(4)]
    assert [round(x, 1) for x in fig1] == [120.0, 31.4, 16.6, 1.9]
    # ZeRO++ (Wang et al. 2023): 3 Psi of stage 3 become 0.75 Psi with qwZ + hpZ + qgZ
    assert ex10.reference(_claim("zeropp_ratio", qwz=True, hpz=True, qgz=True)) == 0.25
    # stage 3 sends 3 Psi against DDP's 2 Psi
    assert ex10.reference(_claim("comm_ratio", stage=3, n=8, accum=1)) == 1.5
    # a ring all-gather: each rank forwards N-1 of the N pieces
    assert ex10.reference(_claim("allgather_sent", gb=8.0, n=4)) == 6.0
    assert ex10.reference(_claim("min_gpus", psi=7.5e9, gpu_gb=32)) == math.ceil(120 / 32)


def test_each_sheet_covers_every_kind_and_mixes_true_and_false():
    for sheet in (ex10.SHEET_A, SHEET_B):
        assert {c.kind for c in sheet} == set(ex10.KINDS)
        assert len({c.id for c in sheet}) == len(sheet)
        marks = [ex10._is_true(c) for c in sheet]
        assert 3 <= sum(marks) <= len(sheet) - 3, marks
    assert not {c.id for c in ex10.SHEET_A} & {c.id for c in SHEET_B}
    table = ex10.sheet_markdown(ex10.SHEET_A)
    assert table.count("\n") == len(ex10.SHEET_A) + 1
    assert all(c.zh in table and c.en in table for c in ex10.SHEET_A)


def test_the_solution_passes_every_check_on_both_sheets():
    fns = _solution_functions()
    for sheet in (ex10.SHEET_A, SHEET_B):
        ex10.check_numbers(fns["correct"], sheet)
        ex10.check_marks(fns["is_true"], sheet)
        ex10.check_calls_zeroedu(fns["correct"], sheet)


def test_checks_name_the_claim_and_the_mistake():
    right = _solution_functions()["correct"]

    def one_way(claim):            # offload's PCIe bytes, one direction only
        if claim.kind == "offload_pcie":
            return 2 * claim.params["psi"] / claim.params["n"] / theory.GB
        return right(claim)

    def doubles(claim):            # "stage 3 communicates twice as much"
        return 2.0 if claim.kind == "comm_ratio" and claim.params["stage"] == 3 else right(claim)

    def typed(claim):              # the visible sheet's values, typed in
        return ex10.reference(claim)

    def whole_tensor(claim):       # "an all-gather sends the whole tensor"
        return claim.params["gb"] if claim.kind == "allgather_sent" else right(claim)

    with pytest.raises(AssertionError, match=r"claim A6: you gave 1\.75 GB.*one direction only"):
        ex10.check_numbers(one_way, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"claim A3: you gave 2 x DDP.*1\.5x, not 2x"):
        ex10.check_numbers(doubles, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"without calling any zeroedu function for claim\(s\) A1, A2, .*A10"):
        ex10.check_calls_zeroedu(typed, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"claim A9: you gave 4 GB.*the whole tensor"):
        ex10.check_numbers(whole_tensor, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"claim B3: you gave 2 x DDP.*repeats all of DDP's 2Ψ"):
        ex10.check_numbers(lambda c: float(c.params["accum"]) if c.kind == "comm_ratio" else right(c), SHEET_B)
    with pytest.raises(AssertionError, match=r"claim A1 is not true: it states 13 GB"):
        ex10.check_marks(lambda claim: True, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"return True or False"):
        ex10.check_marks(lambda claim: 1, ex10.SHEET_A)


def test_the_answer_key_and_literals_behind_a_call_fail_the_calls_check():
    """The audit's cheat: any zeroedu call, then the grader's own reference() or a typed number."""
    right = _solution_functions()["correct"]
    table = {c.id: right(c) for c in ex10.SHEET_A}

    def answer_key(claim):
        theory.optimizer_K()
        return ex10.reference(claim)

    def token_call(claim):
        theory.optimizer_K()
        return table[claim.id]

    def true_for_stage_only(claim):   # an honest formula that ignores gradient accumulation still moves
        if claim.kind == "comm_ratio":
            return theory.comm_volume_paper(claim.params["stage"]) / theory.comm_volume_paper(0)
        return right(claim)

    ex10.check_numbers(answer_key, ex10.SHEET_A)          # the numbers are right: the calls check must catch it
    with pytest.raises(AssertionError, match=r"reached the grader's own code in zeroedu.grading \(reference\) for "
                                             r"claim\(s\) A1, A2, .*A10: that is the answer key"):
        ex10.check_calls_zeroedu(answer_key, ex10.SHEET_A)
    ex10.check_numbers(token_call, ex10.SHEET_A)
    with pytest.raises(AssertionError, match=r"the same number whatever the claim's parameters.*claim A1 \(with "
                                             r"psi=.*claim A10 \(with"):
        ex10.check_calls_zeroedu(token_call, ex10.SHEET_A)
    ex10.check_calls_zeroedu(true_for_stage_only, ex10.SHEET_A)


def test_variants_change_the_true_value_and_the_solution_follows_them():
    right = _solution_functions()["correct"]
    for claim in [*ex10.SHEET_A, *SHEET_B]:
        probes = ex10.variants(claim)
        assert probes and all(p.id == claim.id and p.params != claim.params for p in probes)
        for probe in probes:
            assert ex10.reference(probe) != pytest.approx(ex10.reference(claim), rel=1e-6)
            assert right(probe) == pytest.approx(ex10.reference(probe), rel=1e-6), (probe.params,)


def test_the_hidden_sheet_is_in_no_module_the_exercise_can_import():
    """The kernel can import (and read) all of zeroedu; the second sheet must be in none of it, nor in the
    exercise the learner gets."""
    assert not hasattr(ex10, "SHEET_B")
    package = Path(ex10.__file__).resolve().parents[1]
    sources = {p: p.read_text(encoding="utf-8") for p in package.rglob("*.py")}
    exercise = (EXERCISES / f"{EXERCISE}.ipynb").read_text(encoding="utf-8")
    for claim in SHEET_B:
        for text in (claim.zh, claim.en):
            leaks = [str(p) for p, src in sources.items() if text in src]
            assert not leaks, f"{claim.id}'s wording is readable from the kernel in {leaks}"
            assert text not in exercise and json.dumps(text)[1:-1] not in exercise, claim.id


# -- grading with real kernels -----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_solution_scores_full_marks_and_the_stub_zero():
    want = _points(EXERCISE)
    limits = grader.Limits(cell_timeout=60)
    opts = _sandboxed_or_trusted()   # the sandbox where bubblewrap runs, else --trusted
    [solved] = grader.grade([SOLUTIONS / f"{EXERCISE}.ipynb"], SOLUTIONS, limits, progress=False, options=opts)
    assert {t.grade_id: t.points for t in solved.tests} == want, [(t.grade_id, t.message) for t in solved.tests]
    assert solved.points == sum(want.values()) and any(t.hidden for t in solved.tests)
    [stub] = grader.grade([EXERCISES / f"{EXERCISE}.ipynb"], SOLUTIONS, limits, progress=False, options=opts)
    assert stub.points == 0 and {t.grade_id for t in stub.tests} == set(want)
    for t in stub.tests:
        assert t.message.startswith(("not implemented yet: correct", "not implemented yet: is_true")), t.message


# fixture -> {grade_id of each test that must fail: words its message must contain}
WRONG = {
    "ex10_ignores_accumulation.cells": {
        "ex10-test-numbers": "claim A5: you gave 1 x DDP, which is not right: that ignores gradient accumulation",
        "ex10-test-marks": "claim A5 is not true: it states 1 x DDP",
        "ex10-hidden-numbers": "claim B4: you gave 1.5 x DDP, which is not right: that ignores gradient accumulation",
        "ex10-hidden-marks": "claim B4 is not true",
    },
    "ex10_pcie_one_way.cells": {
        "ex10-test-numbers": "claim A6: you gave 1.75 GB, which is not right: that counts one direction only",
        "ex10-hidden-numbers": "claim B5: you gave 1.625 GB",
        "ex10-hidden-marks": "claim B5 is not false: it states 3.25 GB",
    },
    "ex10_typed_literals.cells": {
        "ex10-test-calls": "without calling any zeroedu function for claim(s) A1, A2, A3, A4, A5, A6, A7, A8, A9, A10",
        "ex10-hidden-numbers": 'your code raised KeyError: "\'B1\'"',
        "ex10-hidden-marks": 'your code raised KeyError: "\'B1\'"',
        "ex10-hidden-calls": 'your code raised KeyError: "\'B1\'"',
    },
    "ex10_answer_key.cells": {
        "ex10-test-calls": "reached the grader's own code in zeroedu.grading (reference) for claim(s) A1, A2, A3",
        "ex10-hidden-calls": "reached the grader's own code in zeroedu.grading (reference) for claim(s) B1, B2, B3",
    },
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", list(WRONG))
def test_wrong_answers_lose_their_points_with_a_pointed_hint(fixture, tmp_path):
    failing = WRONG[fixture]
    path = make_submission(EXERCISE, fixture, tmp_path / "learner")
    [r] = grader.grade([path], SOLUTIONS, grader.Limits(cell_timeout=60), progress=False,
                       options=_sandboxed_or_trusted())
    tests, points = _by_id(r), _points(EXERCISE)
    assert {gid for gid, t in tests.items() if not t.passed} == set(failing), [(t.grade_id, t.message) for t in r.tests]
    for gid, words in failing.items():
        assert words in tests[gid].message, (gid, tests[gid].message)
    assert r.points == sum(points.values()) - sum(points[g] for g in failing)
