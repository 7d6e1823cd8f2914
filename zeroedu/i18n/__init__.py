"""One switch for the language the course speaks: `zeroedu.lang("zh")` in the Chinese notebooks.

Figures, widget labels and check messages call `tr(en, zh)` where they print words; the Chinese edition of each
notebook (notebooks/zh/, built by `python -m zeroedu.i18n build`) sets the switch in its first code cell. The
setting is per process, and it travels to the ranks a notebook launches through the environment variable below, so a
message printed by rank 0 speaks the notebook's language too.
"""

from __future__ import annotations

import os

LANGUAGES = ("en", "zh")
ENV = "ZEROEDU_LANG"


def lang(code: str | None = None) -> str | None:
    """Set the language to `code` ("en" or "zh"); with no argument, return the current one."""
    if code is None:
        return current()
    norm = code.lower().replace("_", "-")
    if norm.startswith("zh"):
        norm = "zh"
    if norm not in LANGUAGES:
        raise ValueError(f"zeroedu.lang({code!r}): the course speaks {' and '.join(LANGUAGES)}; "
                         f"use zeroedu.lang('en') or zeroedu.lang('zh')")
    os.environ[ENV] = norm
    return None


def current() -> str:
    """The language set by lang() in this process (or inherited from the parent), English by default."""
    value = os.environ.get(ENV, "en")
    return value if value in LANGUAGES else "en"


def tr(en: str, zh: str) -> str:
    """The text in the current language: `tr("matches theory", "与理论一致")`."""
    return zh if current() == "zh" else en


__all__ = ["ENV", "LANGUAGES", "current", "lang", "tr"]
