# ruff: noqa: E501  -- 中文 answers: ruff counts a CJK character as two columns
"""Notebook 16's trainer: the 口述 cards and their numbers, the printable sheets, the seeded mock interview and its
scoring, and the widgets (driven by their own buttons)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import nbformat
import pytest

from zeroedu.course import claims, trainer

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def deck() -> list[trainer.Card]:
    return trainer.cards()


def test_every_answer_and_follow_up_of_15_has_a_card_in_both_languages(deck):
    nb = nbformat.read(ROOT / "notebooks" / "15_interview.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    follow_ups = re.findall(r"^### (3\.\d) ", text, re.M)
    cited = {m for c in deck for m in re.findall(r"15 §(3\.\d)", c.source)}
    assert set(follow_ups) <= cited, set(follow_ups) - cited
    assert {"15 §2, 30 seconds", "15 §2, 2 minutes", "15 §2, 5 minutes"} <= {c.source for c in deck}
    for c in deck:
        assert CJK.search(c.q_zh) and CJK.search(c.say_zh), c.key
        assert not CJK.search(c.q_en) and not CJK.search(c.say_en), c.key
        assert re.search(r"\d", c.number) or c.key == "zeror", c.key      # the one number to quote
    assert {"megatron", "hf", "70b", "phi", "infinity", "fsdp2"} <= {c.key for c in deck}


def test_card_numbers_are_the_closed_forms(deck):
    by = {c.key: c for c in deck}
    # 16 bytes per parameter (2 + 2 + 12) and 3Ψ / 2Ψ = 1.5x
    assert "16 字节" in by["30s"].say_zh and "1.5 倍" in by["30s"].say_zh and "1.5x" in by["30s"].say_en
    # the paper's Figure 1: 7.5B on 64 GPUs
    assert "120 → 31.4 → 16.6 → 1.88 GB" in by["30s"].say_en
    # Megatron Core's table: bf16 parameters, fp32 gradients, distributed: 6 + 12/d; at d = 8, 7.5
    assert "7.5" in by["megatron"].number and "5.5" in by["megatron"].say_en
    # Llama 2 70B (68,976,648,192 parameters) x 16 bytes = 1,103.6 GB, at least ceil(1103.6 / 80) = 14 GPUs
    assert "1,103.6 GB" in by["70b"].say_en and f"at least {math.ceil(68_976_648_192 * 16 / 80e9)} GPUs" in by["70b"].say_en
    # hpZ: 2Ψ/g = 2 x 7e9 / 8 bytes = 1.75 GB; MiCS: 16 x 7e9 / 8 = 14 GB
    assert "1.75 GB" in by["hpz"].say_en and "14 GB" in by["infinity"].say_en
    # stage 2 with 16 micro-steps: (16 + 1) / 2 = 8.5x DDP
    assert "8.5x" in by["accum"].say_en


def test_printable_sheets(deck):
    for lang in ("zh", "en"):
        sheet = trainer.flashcards_markdown(deck, lang)
        assert sheet.count("**") >= 4 * len(deck) and all(c.number in sheet for c in deck)
        page = trainer.flashcards_html(deck, lang)
        assert page.count("<tr>") == len(deck) + 1 and "&quot;auto&quot;" in page
    with pytest.raises(ValueError, match="lang must be"):
        trainer.flashcards_markdown(deck, "fr")


def test_mock_walk_is_seeded_and_follows_the_tree():
    walk = trainer.mock_walk(3)
    assert [q.topic for q in walk] == list(trainer.TOPICS)
    assert walk == trainer.mock_walk(3)
    drawn = {q.q_en for seed in range(20) for q in trainer.mock_walk(seed)}
    assert len(drawn) > len(trainer.TOPICS)            # the draw varies between seeds


@pytest.mark.parametrize("q", trainer.questions(), ids=lambda q: q.topic + ":" + q.q_en[:20])
def test_model_answers_score_full_and_gaps_are_named(q):
    assert trainer.score(q, q.model_zh).full and trainer.score(q, q.model_en).full
    vague = trainer.score(q, "it depends on the trade-off")
    assert not vague.full and vague.missing[0].startswith("the number") and len(vague.missing) == 1 + len(q.terms)


def test_a_wrong_number_is_missing_not_found():
    q = next(q for q in trainer.questions() if "DDP's" in q.q_en)
    s = trainer.score(q, "Stage 3 是 DDP 的 2 倍，不是 1.5 倍：前向、反向各 all-gather 一次，再 reduce-scatter")
    assert s.missing == ["the number: 1.5 倍 · 1.5x"] and "all-gather" in s.found
    assert trainer.score(q, "1.5x: all-gather twice and a reduce-scatter").full


def test_widgets_answer_their_buttons(deck):
    box = trainer.flashcard_widget(deck[:2], "en")
    view, (flip, nxt) = box.children[0], box.children[1].children
    assert deck[0].q_en in view.value and deck[0].say_en not in view.value
    flip.click()
    assert deck[0].say_en.split(":")[0] in view.value.replace("&#x27;", "'")
    nxt.click()
    assert "2 / 2" in view.value
    mock = trainer.mock_widget(seed=1, lang="en")
    ask, answer, go, out = mock.children
    first = trainer.mock_walk(1)[0]
    answer.value = first.model_en
    go.click()
    assert out.value.startswith("✓") and "missing" not in out.value and "2/6" in ask.value
    checker = claims.widget("Stage 3 每步通信量是 DDP 的 2 倍。")
    assert checker.children[0].value.startswith("Stage 3")
