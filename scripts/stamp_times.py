"""Measure each lesson's running time and write it into the lesson's header, in English and in 中文.

    .venv/bin/python scripts/stamp_times.py 03 05            # run lessons 03 and 05, record, rewrite headers
    .venv/bin/python scripts/stamp_times.py                  # every lesson (notebooks/NN_*.ipynb)
    .venv/bin/python scripts/stamp_times.py 03 --save-outputs   # also keep the outputs of the run in the notebook
    .venv/bin/python scripts/stamp_times.py --render-only    # rewrite the headers from notebooks/timings.json

Each lesson (the English notebook) runs top to bottom with nbclient, in notebooks/, as a learner's Jupyter would;
its wall time, from kernel start to the last cell, goes into notebooks/timings.json with the machine, the
work other jobs kept busy just before the run (cores' worth, sampled from /proc/stat over 3 s, so the lesson's own
ranks never count as load) and the date. A run that started with more than a quarter of the cores busy is recorded as
"under load": its number is not an idle machine's, and the header says so.

The header's time sentence is the one that starts with **Running time:** (English) and **运行时间：** (the lesson's
msgstr in notebooks/zh/po/NN_name.po); it ends at the first full stop outside parentheses. Only that sentence is
rewritten, in the English cell, in the catalogue's msgid (which must stay the English text) and msgstr, and the
Chinese notebook is rebuilt from the catalogue (python -m zeroedu.i18n build), its saved outputs kept.
tests/test_stamp_times.py checks that every header says what timings.json says.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import nbformat
import polib

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script: import this tree's zeroedu
    sys.path.insert(0, str(ROOT))

from zeroedu.i18n import notebooks as ed  # noqa: E402

EN_START, ZH_START = "**Running time:**", "**运行时间：**"


# -- the sentence: find it, render it --------------------------------------------------------------------------
def sentence_span(text: str, start: str, stop: str) -> tuple[int, int]:
    """(begin, end) of the sentence that starts with `start` and ends at the first `stop` outside parentheses
    (English: a '.' followed by a space, a newline or the end of the cell; Chinese: '。')."""
    begin = text.find(start)
    if begin < 0:
        raise ValueError(f"no {start!r} sentence in the header cell: add one (e.g. '{start} about 20 s.')")
    depth = 0
    for i in range(begin + len(start), len(text)):
        ch = text[i]
        depth += ch in "(（"
        depth -= ch in ")）"
        if depth == 0 and ch == stop and (stop != "." or i + 1 == len(text) or text[i + 1].isspace()):
            return begin, i + 1
    raise ValueError(f"the {start!r} sentence has no closing {stop!r} outside parentheses")


def render_en(entry: dict) -> str:
    s, busy, cores, day = entry["seconds"], entry["others_busy_cores"], entry["cores"], entry["date"][:10]
    if entry["under_load"]:
        return (f"{EN_START} about {s:.0f} s, measured on a {cores}-core CPU under load (the whole notebook with "
                f"nbclient; other jobs kept {busy:.1f} cores busy as it started, {day}); an idle machine is faster.")
    return (f"{EN_START} about {s:.0f} s, measured on an otherwise idle {cores}-core CPU (the whole notebook with "
            f"nbclient, {day}).")


def render_zh(entry: dict) -> str:
    s, busy, cores, day = entry["seconds"], entry["others_busy_cores"], entry["cores"], entry["date"][:10]
    if entry["under_load"]:
        return (f"{ZH_START} 约 {s:.0f} s，有负载时测得（{day}，{cores} 核 CPU 与其他任务共用，开始时其他任务占用约 "
                f"{busy:.1f} 个核，用 nbclient 跑完整个 notebook）；空闲的机器会更快。")
    return f"{ZH_START} 约 {s:.0f} s（{day}，在空闲的 {cores} 核 CPU 上用 nbclient 跑完整个 notebook）。"


def replace_sentence(text: str, start: str, stop: str, new: str) -> str:
    begin, end = sentence_span(text, start, stop)
    return text[:begin] + new + text[end:]


# -- measuring ----------------------------------------------------------------------------------------------------
def machine() -> tuple[str, int]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {cores} cores, {platform.system()}, Python {platform.python_version()}", cores


def others_busy_cores(cores: int, seconds: float = 3.0) -> float:
    """Cores' worth of CPU other processes used over `seconds`, from /proc/stat (the load average would also count
    the previous lesson's ranks for a minute after they exit); the 1-minute load average where /proc is missing."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return os.getloadavg()[0]
    return cores * (1 - (idle1 - idle0) / max(1, total1 - total0))


def run_lesson(path: Path, timeout: int, save_outputs: bool) -> dict:
    """Run one notebook with nbclient; return its timings.json entry."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    what, cores = machine()
    busy = others_busy_cores(cores)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - t0
    if save_outputs:
        nbformat.write(nb, path)
    return {"seconds": round(seconds, 1), "others_busy_cores": round(busy, 2), "cores": cores, "machine": what,
            "under_load": busy > cores / 4, "conditions": "under load" if busy > cores / 4 else "quiet",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "how": "nbclient, the whole English notebook, kernel start to last cell"}


# -- writing --------------------------------------------------------------------------------------------------------
def header_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and EN_START in cell.source:
            return cell
    raise ValueError(f"no markdown cell with {EN_START!r}")


def stamp(english: Path, entry: dict) -> None:
    """Rewrite the time sentence of `english`'s header, its catalogue entry, and rebuild its Chinese notebook."""
    nb = nbformat.read(english, as_version=4)
    cell = header_cell(nb)
    old_en = cell.source
    cell.source = replace_sentence(old_en, EN_START, ".", render_en(entry))
    nbformat.write(nb, english)
    po_file = ed.po_path(english)
    if not po_file.exists():
        return
    po = polib.pofile(str(po_file), wrapwidth=0)
    hit = next((e for e in po if e.msgctxt == cell.id and not e.obsolete), None)
    if hit is None:
        raise ValueError(f"{po_file.name} has no entry for the header cell {cell.id}: "
                         f"run `python -m zeroedu.i18n extract {english.stem}`")
    if hit.msgid == old_en:   # only a current translation follows the English: a stale one stays stale
        hit.msgid = cell.source
    hit.msgstr = replace_sentence(hit.msgstr, ZH_START, "。", render_zh(entry))
    po.save(str(po_file))
    zh = ed.zh_path(english)
    previous = nbformat.read(zh, as_version=4) if zh.exists() else None
    nbformat.write(ed.build(english, previous), zh)


def timings_path() -> Path:
    return ed.NOTEBOOKS / "timings.json"


def load_timings() -> dict:
    path = timings_path()
    return json.loads(path.read_text()) if path.exists() else {"lessons": {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="*", help="lesson numbers or names (default: every lesson)")
    ap.add_argument("--save-outputs", action="store_true", help="keep the run's outputs in the English notebook")
    ap.add_argument("--render-only", action="store_true", help="rewrite headers from timings.json, run nothing")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = ap.parse_args(argv)
    all_lessons = ed.english_notebooks()
    picked = [p for p in all_lessons if not args.lessons or any(p.stem.startswith(a) for a in args.lessons)]
    if args.lessons and len(picked) < len(args.lessons):
        raise SystemExit(f"no lesson for some of {args.lessons}: the lessons are {[p.stem for p in all_lessons]}")
    timings = load_timings()
    for path in picked:
        if args.render_only:
            if path.stem not in timings["lessons"]:
                raise SystemExit(f"{path.stem} has no entry in {timings_path()}: run it first (without --render-only)")
        else:
            entry = run_lesson(path, args.timeout, args.save_outputs)
            timings["lessons"][path.stem] = entry
            timings_path().write_text(json.dumps(timings, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
            print(f"{path.stem}: {entry['seconds']:.0f} s with {entry['others_busy_cores']} cores busy before it"
                  + (" (under load)" if entry["under_load"] else ""), flush=True)
        stamp(path, timings["lessons"][path.stem])
    if args.save_outputs:   # nbclient stamps execution times into every cell's metadata, the setup cell's too:
        # put back the setup cells exactly as scripts/setup_cell.py writes them (tests/test_setup_cell.py checks)
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "scripts" / "setup_cell.py")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
