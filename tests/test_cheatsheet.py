"""The cheat sheet (docs/cheatsheet.md, docs/cheatsheet.zh.md) is the current rendering of zeroedu.theory, and every
number on it equals the closed forms of the ZeRO and ZeRO++ papers, written out here by hand."""

from __future__ import annotations

import re

import pytest

from zeroedu.course import cheatsheet

K = 12


def paper_bytes_per_param(stage: int, n: int) -> float:
    """ZeRO paper, Sec. 5: 2 (16-bit params) + 2 (16-bit grads) + K, partitioned from stage 1, 2, 3 on."""
    return 2 / (n if stage >= 3 else 1) + 2 / (n if stage >= 2 else 1) + K / (n if stage >= 1 else 1)


def _rows(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    return rows[1:]


def _num(cell: str) -> float:
    return float(re.match(r"[\d.]+", cell).group())


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_files_are_the_current_rendering(lang):
    assert cheatsheet.FILES[lang].read_text(encoding="utf-8") == cheatsheet.render(lang), \
        "run `python -m zeroedu.course.cheatsheet` to regenerate docs/cheatsheet*.md"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_numbers_equal_the_closed_forms(lang):
    text = cheatsheet.FILES[lang].read_text(encoding="utf-8")
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    memory, comm, ring, offload, zpp, examples = _rows_by_heading(text, heads)
    assert [int(r[0]) for r in memory] == [0, 1, 2, 3]
    for row in memory:
        stage = int(row[0])
        for cell, n in zip(row[3:], (8, 64), strict=True):
            assert _num(cell) == pytest.approx(paper_bytes_per_param(stage, n), rel=5e-3), (stage, n, cell)
    assert [(r[2], r[3], r[4]) for r in comm] == [("2Ψ", "4Ψ", "1×")] * 3 + [("3Ψ", "6Ψ", "1.5×")]
    for row, factor in zip(ring, (2, 1, 1), strict=True):
        for cell, n in zip(row[2:], (8, 64), strict=True):
            assert _num(cell) == pytest.approx(factor * (n - 1) / n, rel=5e-3)
    n = 8
    assert [_num(r[2]) for r in offload] == pytest.approx([2, (4 + K) / n, 4 / n])
    # ZeRO++ paper (Wang et al. 2023): forward gather 1 -> 0.5 (int8), backward gather 1 -> 0 (hpZ), grads 1 -> 0.25
    assert [_num(r[1]) for r in zpp] == [3, 2, 2, 2.25, 0.75]
    for row in examples:
        psi, world = _num(row[0]) * 1e9, int(row[1])
        for stage, cell in enumerate(row[2:]):
            gb = paper_bytes_per_param(stage, world) * psi / 1e9
            assert _num(cell) == pytest.approx(gb, abs=0.051)   # printed to one decimal
            assert cell.endswith("✗") == (gb > 80)


def _rows_by_heading(text: str, heads: list[str]) -> list[list[list[str]]]:
    assert len(heads) == 6, heads
    return [_rows(text, h) for h in heads]


def test_seven_b_on_eight_gpus_is_the_familiar_example():
    """7B, N = 8, stage 3: (2 + 2 + 12) x 7e9 / 8 = 14 GB, the number interview answers quote."""
    row = next(r for r in _rows(cheatsheet.render("en"), heads_of(cheatsheet.render("en"))[-1])
               if r[0] == "7B" and r[1] == "8")
    assert row[-1] == "14.0"


def heads_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]
