"""The helpers behind the try-it cells of notebooks 12 and 17 hold their closed forms at settings the notebooks do
not use: zero.Init's construction peak on 3 ranks (course_big.init_peaks), and case 8's bytes per optimizer step
under gradient accumulation at stage 3 (casebook.accumulation_bytes)."""

from __future__ import annotations

import pytest

import zeroedu
from zeroedu import course_big
from zeroedu.course import casebook

pytestmark = pytest.mark.timeout(300)


def test_init_peaks_match_the_closed_form_of_notebook_12():
    world, sizes = 3, (17, 50, 200, 7)      # widths N does not divide: every piece is padded
    numels = [a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
    pieces = [4 * -(-n // world) for n in numels]
    want = max(sum(pieces[:k]) + 4 * n + pieces[k] for k, n in enumerate(numels)) + 8 * 2 * (1 + world)
    for peaks in zeroedu.launch(course_big.init_peaks, world_size=world, args=(sizes,)):
        assert isinstance(peaks, course_big.InitPeaks)
        assert (peaks.whole, peaks.inside) == (4 * sum(numels), want)


def test_accumulation_bytes_at_stage_3_grow_with_the_micro_steps():
    for acc in zeroedu.launch(casebook.accumulation_bytes, world_size=2, args=(3, 2)):
        assert (acc.stage, acc.accum) == (3, 2)
        assert acc.many == 2 * acc.one > 0  # stage 3 gathers and reduce-scatters at every micro-step: A times
