"""Feedback an instructor can hand back: `zeroedu grade FOLDER --feedback DIR` writes DIR/<learner>.html.

One page per learner, self-contained (inline CSS, no script, no link to fetch), in English with the 中文 labels
beside them: each exercise's score, every check with ✓/✗, its points, the grader's message, and for a failed
check the first of its progressive hints (hints.py), which points the way without giving the answer. Every
learner-controlled string (folder names, check names, messages) is HTML-escaped, and the file name is made from
the folder name with anything but letters, digits, '-', '_' and '.' replaced, so a folder cannot write outside DIR.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from zeroedu.grading.results import ExerciseResult

_CSS = """body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:.35em .5em;text-align:left;vertical-align:top}
.pass{color:#17692e}.fail{color:#b3261e}.msg{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.9em}
.hint{background:#f4f6fb;padding:.3em .5em;margin-top:.3em}.note{color:#555}"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(x: float) -> str:
    return f"{x:g}"


def file_name(learner: str) -> str:
    """A safe file name for a learner's page: never a path, never hidden, never empty."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", learner).lstrip(".") or "learner"
    return stem[:100] + ".html"


def page(learner: str, results: list[ExerciseResult], learner_id: str = "") -> str:
    from zeroedu.grading import hints

    points = sum(r.points for r in results)
    full = sum(r.max_points for r in results)
    who = _e(learner) + (f" ({_e(learner_id)})" if learner_id else "")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>Feedback 反馈: {_e(learner)}</title><style>{_CSS}</style></head><body>",
           f"<h1>Feedback 反馈: {who}</h1>", f"<p>Total 总分: <b>{_num(points)}/{_num(full)}</b></p>"]
    if not results:
        out.append('<p class="note">No submission was found for you. 没有找到你的提交。</p>')
    for r in sorted(results, key=lambda r: r.exercise):
        out.append(f"<h2>{_e(r.exercise)}: {_num(r.points)}/{_num(r.max_points)}</h2>")
        if r.status != "graded":
            out.append(f'<p class="note">{_e(r.status)}</p>')
        if r.tests:
            out.append("<table><tr><th></th><th>check 检查</th><th>points 得分</th><th>message 说明</th></tr>")
            for t in r.tests:
                mark = '<span class="pass">✓</span>' if t.passed else '<span class="fail">✗</span>'
                name = _e(t.name) + (" <i>(hidden 隐藏测试)</i>" if t.hidden else "")
                cell = f'<div class="msg">{_e(t.message)}</div>' if t.message else ""
                if not t.passed:
                    hint = hints.hint_for(t.grade_id, 1)
                    if hint is not None:
                        cell += (f'<div class="hint">Hint 提示: {_e(hint[0])}<br>{_e(hint[1])}</div>')
                out.append(f"<tr><td>{mark}</td><td>{name}</td><td>{_num(t.points)}/{_num(t.max_points)}</td>"
                           f"<td>{cell}</td></tr>")
            out.append("</table>")
        for note in r.notes:
            out.append(f'<p class="note">{_e(note)}</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_all(results: list[ExerciseResult], folder: Path, roster: dict | None = None) -> list[Path]:
    """One page per learner in `folder`; two folders that map to one file name get -2, -3 ... suffixes."""
    folder.mkdir(parents=True, exist_ok=True)
    by: dict[str, list[ExerciseResult]] = {}
    for r in results:
        by.setdefault(r.learner, []).append(r)
    for name in roster or {}:          # a roster learner who handed nothing in still gets a page saying so
        by.setdefault(name, [])
    written: list[Path] = []
    used: set[str] = set()
    for learner, rs in by.items():
        name = file_name(learner)
        k = 2
        while name in used:
            name = file_name(learner)[:-5] + f"-{k}.html"
            k += 1
        used.add(name)
        known = (roster or {}).get(learner)
        path = folder / name
        path.write_text(page(learner, rs, getattr(known, "id", "")), encoding="utf-8")
        written.append(path)
    return written
