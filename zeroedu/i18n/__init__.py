"""One switch for the language the course speaks: `zeroedu.lang("zh")` in the Chinese notebooks.

Figures, widget labels and check messages call `tr(en, zh)` where they print words; the Chinese edition of each
notebook (notebooks/zh/, built by `python -m zeroedu.i18n build`) sets the switch in its first code cell. The
setting is per process, and it travels to the ranks a notebook launches through the environment variable below, so a
message printed by rank 0 speaks the notebook's language too.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

LANGUAGES = ("en", "zh")
ENV = "ZEROEDU_LANG"
# Set by speaking(): the language of one thread's work (and of the asyncio tasks and asyncio.to_thread workers it
# starts, which copy its context), over the process's setting. The grader grades two notebooks at once, in threads.
_SPEAKING: contextvars.ContextVar[str | None] = contextvars.ContextVar("zeroedu_speaking", default=None)


def _normalized(code: str, where: str) -> str:
    norm = code.lower().replace("_", "-")
    if norm.startswith("zh"):
        norm = "zh"
    if norm not in LANGUAGES:
        raise ValueError(f"{where}({code!r}): the course speaks {' and '.join(LANGUAGES)}; "
                         f"use zeroedu.lang('en') or zeroedu.lang('zh')")
    return norm


def lang(code: str | None = None) -> str | None:
    """Set the language to `code` ("en" or "zh"); with no argument, return the current one."""
    if code is None:
        return current()
    os.environ[ENV] = _normalized(code, "zeroedu.lang")
    return None


def current() -> str:
    """The language of this thread's speaking() block, else the one set by lang() in this process (or inherited
    from the parent), English by default."""
    value = _SPEAKING.get() or os.environ.get(ENV, "en")
    return value if value in LANGUAGES else "en"


@contextlib.contextmanager
def speaking(code: str) -> Iterator[None]:
    """Within the block, tr() says `code`'s text in this thread only: `zeroedu grade` grades a Chinese notebook
    in Chinese beside an English one."""
    token = _SPEAKING.set(_normalized(code, "zeroedu.i18n.speaking"))
    try:
        yield
    finally:
        _SPEAKING.reset(token)


def tr(en: str, zh: str) -> str:
    """The text in the current language: `tr("matches theory", "与理论一致")`."""
    return zh if current() == "zh" else en


__all__ = ["ENV", "LANGUAGES", "current", "lang", "speaking", "tr"]
