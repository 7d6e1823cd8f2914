"""scripts/stamp_times.py: every lesson header's running time is the one notebooks/timings.json recorded, in English
and in 中文, and the script rewrites that one sentence and nothing else (so the lead can re-time all lessons)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import nbformat
import polib
import pytest

from zeroedu.i18n import notebooks as ed

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stamp_times", ROOT / "scripts" / "stamp_times.py")
stamp_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stamp_times)
TIMINGS = json.loads((ROOT / "notebooks" / "timings.json").read_text())["lessons"]


def _header(path: Path) -> nbformat.NotebookNode:
    return stamp_times.header_cell(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("stem", sorted(TIMINGS))
def test_header_number_is_the_measured_one_in_both_languages(stem):
    entry = TIMINGS[stem]
    english = ROOT / "notebooks" / f"{stem}.ipynb"
    cell = _header(english)
    # the number a reader sees, read back from the prose (not from the renderer)
    assert re.search(r"\*\*Running time:\*\* about (\d+) s[ ,]", cell.source)[1] == f"{entry['seconds']:.0f}"
    assert ("under load" in cell.source) == entry["under_load"] == (entry["conditions"] == "under load")
    zh_text = next(e.msgstr for e in polib.pofile(str(ed.po_path(english))) if e.msgctxt == cell.id)
    built = next(c.source for c in nbformat.read(ed.zh_path(english), as_version=4).cells if c.id == cell.id)
    for text in (zh_text, built):
        assert re.search(r"\*\*运行时间：\*\* 约 (\d+) s[，（]", text)[1] == f"{entry['seconds']:.0f}"
        assert ("有负载" in text) == entry["under_load"]


@pytest.mark.parametrize("english", ed.english_notebooks(), ids=lambda p: p.stem)
def test_every_lesson_has_a_sentence_the_script_can_rewrite(english):
    """The lead re-times all lessons: each header (English and its msgstr) has one sentence the script finds."""
    text = _header(english).source
    begin, end = stamp_times.sentence_span(text, stamp_times.EN_START, ".")
    assert text[end - 1] == "." and text.count(stamp_times.EN_START) == 1
    if ed.po_path(english).exists():
        zh = next(e.msgstr for e in polib.pofile(str(ed.po_path(english))) if e.msgctxt == _header(english).id)
        begin, end = stamp_times.sentence_span(zh, stamp_times.ZH_START, "。")
        assert zh[end - 1] == "。"


def test_stamp_rewrites_only_the_time_sentence(tmp_path, monkeypatch):
    english = ROOT / "notebooks" / "90_appendix_gpu.ipynb"
    root = tmp_path / "notebooks"
    (root / "zh" / "po").mkdir(parents=True)
    for src, dst in [(english, root / english.name), (ed.po_path(english), root / "zh" / "po" / f"{english.stem}.po"),
                     (ed.zh_path(english), root / "zh" / english.name)]:
        shutil.copy(src, dst)
    monkeypatch.setattr(ed, "NOTEBOOKS", root)
    monkeypatch.setattr(ed, "ZH", root / "zh")
    monkeypatch.setattr(ed, "PO", root / "zh" / "po")
    copy = root / english.name
    before = nbformat.read(copy, as_version=4)
    entry = {"seconds": 12.4, "others_busy_cores": 1.7, "cores": 2, "under_load": True, "conditions": "under load",
             "date": "2026-12-06T09:00:00+00:00", "machine": "test", "how": "test"}
    stamp_times.stamp(copy, entry)
    after = nbformat.read(copy, as_version=4)
    assert ed.check(copy).ok, ed.check(copy).describe()        # catalogue current, Chinese notebook rebuilt
    for b, a in zip(before.cells, after.cells, strict=True):
        if b.id != _header(english).id:
            assert b == a
            continue
        i, j = stamp_times.sentence_span(b.source, stamp_times.EN_START, ".")
        k, m = stamp_times.sentence_span(a.source, stamp_times.EN_START, ".")
        assert (b.source[:i], b.source[j:]) == (a.source[:k], a.source[m:])
        assert a.source[k:m] == ("**Running time:** about 12 s, measured on a 2-core CPU under load (the whole "
                                 "notebook with nbclient; other jobs kept 1.7 cores busy as it started, 2026-12-06); "
                                 "an idle machine is faster.")
    zh = nbformat.read(root / "zh" / english.name, as_version=4)
    assert ("**运行时间：** 约 12 s，有负载时测得（2026-12-06，2 核 CPU 与其他任务共用，"
            "开始时其他任务占用约 1.7 个核，") in \
        next(c.source for c in zh.cells if c.id == _header(english).id)


def test_a_header_without_the_sentence_is_named():
    with pytest.raises(ValueError, match="no '\\*\\*Running time:\\*\\*' sentence"):
        stamp_times.sentence_span("# 00 · Title\n", stamp_times.EN_START, ".")
    with pytest.raises(ValueError, match="no closing"):
        stamp_times.sentence_span("**Running time:** about 3 s (oops.", stamp_times.EN_START, ".")
