"""Sphinx configuration of the course book (`make book`), shared by the English and the Chinese build.

scripts/build_book.py stages each language's sources (the notebooks with their saved outputs, the glossary, the
cheat sheet) and runs sphinx-build once per language with `-D language=en|zh_CN`. No notebook is executed: the book
shows what the notebooks saved.
"""

from __future__ import annotations

import os
import re

project = "zeroedu"
author = "the zeroedu authors"
extensions = ["myst_nb"]
nb_execution_mode = "off"            # read saved outputs; never run a notebook while building
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence", "html_image"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
templates_path = [os.path.join(os.path.dirname(__file__), "_templates")]
html_static_path = [os.path.join(os.path.dirname(__file__), "_static")]
html_css_files = ["zeroedu.css"]
html_theme = "sphinx_book_theme"
html_title = "zeroedu"
# the course's repository, declared once in pyproject.toml [project.urls] (read with a regex: tomllib is 3.11+)
_PYPROJECT = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
with open(_PYPROJECT, encoding="utf-8") as _f:
    REPOSITORY = re.search(r'^Repository\s*=\s*"([^"]+)"', _f.read(), re.MULTILINE).group(1)
html_theme_options = {
    "article_header_end": ["langswitch.html", "article-header-buttons.html"],
    "show_toc_level": 2,
    "use_download_button": True,
    "repository_url": REPOSITORY,
    "repository_branch": "main",
    "use_repository_button": True,
}
BOOK_LANG = os.environ.get("ZEROEDU_BOOK_LANG", "en")
OTHER = {"en": ("zh", "中文"), "zh": ("en", "English")}[BOOK_LANG]
# the language switch (_templates/langswitch.html): the same page under the other language's root
html_context = {"zeroedu_other": OTHER[0], "zeroedu_other_name": OTHER[1]}
html_search_language = BOOK_LANG
html_js_files = ["zh_stemmer.js"] if BOOK_LANG == "zh" else []
html_copy_source = False
