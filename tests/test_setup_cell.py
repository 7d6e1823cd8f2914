"""The notebooks' first cells (badges, setup) come from scripts/setup_cell.py, and the setup cell does what it says:
nothing where zeroedu is importable; on a runtime with a torch out of range, or with no internet, it stops with
the versions, the range and the fix before installing anything; and (slow) on a fresh venv with another Python and
another torch it installs the course, runs a notebook through and leaves that torch as it was."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("setup_cell", ROOT / "scripts" / "setup_cell.py")
setup_cell = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_cell)

NOTEBOOKS = setup_cell.notebooks()


def test_every_notebook_opens_with_the_generated_cells():
    assert len(NOTEBOOKS) >= 30 and {p.parent.name for p in NOTEBOOKS} == {"notebooks", "solutions", "exercises"}
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        want = setup_cell.cells_for(path.relative_to(ROOT).as_posix())
        assert [c["cell_type"] for c in cells[:2]] == ["markdown", "code"], path
        assert "".join(cells[1]["source"]) == setup_cell.cell_source(), f"{path}: run python scripts/setup_cell.py"
        assert cells[1]["outputs"] == [], f"{path}: the setup cell's saved output must be empty (nbval compares it)"
        assert cells[:2][0]["metadata"] == want[0]["metadata"] and cells[1]["metadata"] == want[1]["metadata"], path
        badge = "".join(cells[0]["source"])
        assert "colab.research.google.com/github/" in badge and "ModelScope" in badge and "魔搭" in badge, path
        shown = path.relative_to(ROOT).as_posix().replace("solutions/", "exercises/")
        assert badge.count(shown) == 1, f"{path}: the Colab badge opens {shown}"
        # the rest of the notebook has no second copy
        assert sum(setup_cell.TAG in c.get("metadata", {}).get("tags", []) for c in cells) == 2, path
    assert setup_cell.main(["--check"]) == 0


def test_the_script_is_idempotent_and_keeps_the_rest(tmp_path, monkeypatch):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    src = ROOT / "notebooks" / "01_memory_anatomy.ipynb"
    original = json.loads(src.read_text(encoding="utf-8"))
    bare = dict(original, cells=[c for c in original["cells"] if setup_cell.TAG not in c["metadata"].get("tags", [])])
    target = folder / src.name
    target.write_text(json.dumps(bare, sort_keys=True, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")   # the cell's ranges come from it
    monkeypatch.setattr(setup_cell, "ROOT", tmp_path)
    assert setup_cell.apply(target) is True
    once = target.read_text(encoding="utf-8")
    assert setup_cell.apply(target) is False and target.read_text(encoding="utf-8") == once
    again = json.loads(once)
    assert again["cells"][2:] == bare["cells"]            # only the top changed
    # what the repository holds, but for the number a run of the notebook gave the setup cell (the script keeps it)
    held = json.loads(src.read_text(encoding="utf-8"))
    for cell in held["cells"]:
        if setup_cell.TAG in cell["metadata"].get("tags", []) and cell["cell_type"] == "code":
            cell["execution_count"] = None
    assert json.loads(once) == held


# -- the repository's URL: declared once, stamped everywhere ---------------------------------------------------------

COLAB = re.compile(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/")
BINDER = re.compile(r"mybinder\.org/v2/gh/([\w.-]+/[\w.-]+)/")
SOURCE = re.compile(r'os\.environ\.get\("ZEROEDU_SOURCE", "([^"]+)"\)')


def _declared_url(root: Path = ROOT) -> str:
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        import tomli as tomllib
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _course_links(path: Path) -> dict[str, list[str]]:
    """Every place a file names the course's repository: Colab badges, Binder badges, the setup cell's source
    (a notebook is read as its cells' sources, a catalogue or the README as text)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    return {"colab": COLAB.findall(text), "binder": BINDER.findall(text), "source": SOURCE.findall(text)}


def _stamped_files(root: Path) -> list[Path]:
    return sorted([*root.glob("notebooks/*.ipynb"), *root.glob("notebooks/zh/*.ipynb"),
                   *root.glob("notebooks/zh/po/*.po"), *root.glob("solutions/*.ipynb"),
                   *root.glob("exercises/*.ipynb"), root / "README.md"])


def test_every_copy_of_the_repository_url_agrees_with_pyproject():
    """pyproject.toml [project.urls] Repository is the one declaration: every notebook's setup cell fetches from it,
    every Colab badge (English, 中文, the catalogues' badge entries) and the README's Colab and Binder badges open
    it, the book's repository button links it; no file names another repository for the course."""
    url = _declared_url()
    owner_repo = url.removeprefix("https://github.com/")
    files = _stamped_files(ROOT)
    assert len(files) >= 70, files
    for path in files:
        links = _course_links(path)
        assert links["colab"], f"{path}: no Colab badge"
        assert set(links["colab"]) | set(links["binder"]) == {owner_repo}, (path, links)
        if path.suffix == ".ipynb":
            assert links["source"] == [url], (path, links["source"])
    readme = _course_links(ROOT / "README.md")
    assert readme["binder"] == [owner_repo] and len(readme["colab"]) == 1
    conf = subprocess.run([sys.executable, "-c", "import runpy, sys; "
                           "print(runpy.run_path(sys.argv[1])['html_theme_options']['repository_url'])",
                           str(ROOT / "docs" / "book" / "conf.py")], capture_output=True, text=True, check=True)
    assert conf.stdout.strip() == url


def _course_copy(tmp_path: Path) -> Path:
    """A small course: pyproject, README, lesson 00 in English and 中文 with its catalogue, exercise 01."""
    for rel in ["pyproject.toml", "README.md", "notebooks/00_start_here.ipynb", "notebooks/zh/00_start_here.ipynb",
                "notebooks/zh/po/00_start_here.po", "solutions/ex01_memory_formulas.ipynb",
                "exercises/ex01_memory_formulas.ipynb"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def _without(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if not any(n in line for n in needles)]


def test_a_new_repository_url_is_restamped_everywhere_with_one_command(tmp_path, monkeypatch, capsys):
    """Change the declaration, run `python scripts/setup_cell.py` once: every badge and setup cell names the new
    repository, nothing names the old one, and nothing else in those files moved (the lessons' own cells, the other
    catalogue entries, the rest of the README). A second run changes nothing."""
    root = _course_copy(tmp_path)
    old = _declared_url()
    new = "https://github.com/example-org/zeroedu-course"
    pyproject = root / "pyproject.toml"
    assert pyproject.read_text().count(f'Repository = "{old}"') == 1
    pyproject.write_text(pyproject.read_text().replace(f'Repository = "{old}"', f'Repository = "{new}"'))
    before = {p: p.read_text(encoding="utf-8") for p in _stamped_files(root)}
    monkeypatch.setattr(setup_cell, "ROOT", root)
    assert setup_cell.main(["--check"]) == 1          # the copies are stale until re-stamped
    assert setup_cell.main([]) == 0
    assert "4 of 4 notebooks updated, and the README (repository " + new in capsys.readouterr().out
    after = {p: p.read_text(encoding="utf-8") for p in before}
    old_repo, new_repo = old.removeprefix("https://github.com/"), new.removeprefix("https://github.com/")
    for path, text in after.items():
        links = _course_links(path)
        assert set(links["colab"]) | set(links["binder"]) == {new_repo}, (path, links)
        assert old_repo not in text, path
        assert links["source"] == ([new] if path.suffix == ".ipynb" else []), path
        if path.suffix == ".ipynb":   # the cells below the two stamped ones are untouched
            assert json.loads(text)["cells"][2:] == json.loads(before[path])["cells"][2:], path
        else:                          # README and catalogue: only the lines that name the repository changed
            assert _without(text, old_repo, new_repo) == _without(before[path], old_repo, new_repo), path
    assert setup_cell.main(["--check"]) == 0
    assert setup_cell.main([]) == 0 and {p: p.read_text(encoding="utf-8") for p in before} == after


def test_a_repository_url_colab_cannot_open_is_refused(tmp_path, monkeypatch):
    root = _course_copy(tmp_path)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'Repository = "{_declared_url()}"',
                                                       'Repository = "git@gitee.com:zeroedu/zeroedu.git"'))
    monkeypatch.setattr(setup_cell, "ROOT", root)
    with pytest.raises(SystemExit, match=r"\[project.urls\] Repository is 'git@gitee.com:zeroedu/zeroedu.git'; "
                                         r"it must be the course's GitHub URL"):
        setup_cell.main([])


def _run_cell(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    code = setup_cell.cell_source()
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=cwd)


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROEDU_")}
    return {**env, "HOME": str(home), **extra}


@pytest.mark.timeout(150)
def test_setup_cell_is_silent_where_zeroedu_is_importable(tmp_path):
    proc = _run_cell(_clean_env(tmp_path, PYTHONPATH=str(ROOT)), tmp_path)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_setup_cell_without_internet_stops_before_installing(tmp_path):
    """A source whose host cannot be reached (.invalid never resolves, RFC 6761): the cell names the host, says
    there is no internet and what to do, and leaves nothing behind (no clone, no install)."""
    env = _clean_env(tmp_path, PYTHONPATH=str(ROOT), ZEROEDU_SETUP="force",
                     ZEROEDU_SOURCE="https://course.invalid/zeroedu.git")
    proc = _run_cell(env, tmp_path)
    assert proc.returncode != 0
    assert "zeroedu setup stopped, nothing installed: cannot reach course.invalid" in proc.stderr, proc.stderr
    assert "no internet" in proc.stderr and "ZEROEDU_SOURCE" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_setup_cell_refuses_a_torch_outside_the_range(tmp_path):
    """A runtime whose torch is older than the range (a stand-in distribution named torch, version 2.5.1: the cell
    reads only the installed version before deciding). It names the version, the range and the fix."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.5.1+cu121"\n')
    dist = tmp_path / "site" / "torch-2.5.1+cu121.dist-info"        # what importlib.metadata reads
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1+cu121\n")
    env = _clean_env(tmp_path, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}", ZEROEDU_SETUP="force")
    proc = _run_cell(env, tmp_path)
    assert proc.returncode != 0
    assert "torch 2.5.1+cu121 is outside zeroedu's range, 2.8 to 2.15" in proc.stderr, proc.stderr
    assert "pip install torch==2.13.0" in proc.stderr and not (tmp_path / "zeroedu").exists()


@pytest.mark.timeout(150)
def test_setup_cell_with_a_missing_wheel_stops_before_installing(tmp_path):
    env = _clean_env(tmp_path, PYTHONPATH=str(ROOT), ZEROEDU_SETUP="force",
                     ZEROEDU_SOURCE=str(tmp_path / "zeroedu-0.1.0-py3-none-any.whl"))
    proc = _run_cell(env, tmp_path)
    assert proc.returncode != 0
    assert f"nothing installed: there is no wheel at {tmp_path}/zeroedu-0.1.0-py3-none-any.whl" in proc.stderr, \
        proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(600)
def test_setup_cell_installs_from_a_wheel_and_the_same_kernel_imports_it(tmp_path):
    """Where GitHub is slow or blocked (a ModelScope runtime), ZEROEDU_SOURCE names a wheel. A venv that sees this
    environment's packages (torch, numpy, ...) but not zeroedu stands in for the runtime: the cell installs the
    wheel beside that torch, and the same process then imports zeroedu from the venv, not from this checkout."""
    try:   # the wheel is built here, offline, with this environment's setuptools (pyproject's build-system)
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        setuptools_major = 0
    if setuptools_major < 77:
        pytest.skip("building zeroedu's wheel offline needs setuptools>=77 in this environment")
    src = tmp_path / "src"   # the package's files, built into a wheel as a release would be
    for rel in ["pyproject.toml", "README.md"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, src / rel)
    shutil.copytree(ROOT / "zeroedu", src / "zeroedu", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("zeroedu-*.whl")
    # the runtime's packages: everything installed here but zeroedu, seen through a .pth file
    host = tmp_path / "host"
    host.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        if "zeroedu" not in entry.name:
            (host / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "runtime.pth").write_text(f"{host}\n")
    probe = "import importlib.metadata as m, importlib.util as u; print(m.version('torch'), u.find_spec('zeroedu'))"
    env = {k: v for k, v in _clean_env(tmp_path).items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    before = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True, env=env,
                            cwd=tmp_path).stdout.split()
    assert before[1] == "None", before   # the runtime has no zeroedu
    code = setup_cell.cell_source() + "\nimport zeroedu, torch\nprint('IMPORTED', zeroedu.__file__, torch.__version__)"
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=540, cwd=tmp_path,
                          env={**env, "ZEROEDU_SOURCE": str(wheel)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"zeroedu installed from {wheel}, beside torch {before[0]}." in proc.stdout, proc.stdout
    imported = proc.stdout.split("IMPORTED ")[1].split()
    assert imported[0].startswith(str(site / "zeroedu")) and imported[1] == before[0], imported
    assert sorted(p.name for p in host.iterdir()) == sorted(e.name for e in purelib.iterdir() if "zeroedu" not in
                                                            e.name)   # the runtime's own packages: untouched


# -- done when: a fresh venv with another Python and another torch --------------------------------------------------

MATRIX_WHEELS = Path(os.environ.get("MATRIX_WHEELS", Path.home() / ".cache" / "zeroedu-matrix" / "wheels"))
# pyenv's own 3.12 before PATH's python3.12 (with pyenv, that is a shim that may not run), as the Makefile does
MATRIX_PY = os.environ.get("MATRIX_PY") or str(
    next(iter(sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), "")) or shutil.which("python3.12")
MATRIX_TORCH = os.environ.get("MATRIX_TORCH", "2.14.1")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_setup_cell_installs_beside_another_torch_and_a_notebook_runs(tmp_path):
    """A fresh venv on another Python with another torch in the range and a Jupyter kernel, no zeroedu. Notebook 00,
    run through with nbclient from its first cell: the setup cell installs the course (from a clean copy of this
    checkout, ZEROEDU_SOURCE) and every later cell runs; torch is the same version, same files, afterwards.
    Needs MATRIX_PY and MATRIX_WHEELS (torch for that Python; `make test-matrix` documents the download)."""
    if not os.environ.get("ZEROEDU_MATRIX"):   # gigabytes of torch into a fresh venv: too heavy for every CI run
        pytest.skip("part of `make test-matrix` (ZEROEDU_MATRIX=1), not of every test run")
    wheels = sorted(MATRIX_WHEELS.glob(f"torch-{MATRIX_TORCH}-*.whl"))
    if not MATRIX_PY or not Path(MATRIX_PY).exists() or not wheels:
        pytest.skip(f"needs MATRIX_PY (found {MATRIX_PY!r}) and torch {MATRIX_TORCH} wheels in {MATRIX_WHEELS}")
    venv = tmp_path / "venv"
    subprocess.run([MATRIX_PY, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--find-links", str(MATRIX_WHEELS), f"torch=={MATRIX_TORCH}",
                    "nbclient", "ipykernel"], check=True, timeout=1200)
    probe = "import torch, sys; print(torch.__version__, torch.__file__, sys.version.split()[0])"
    before = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout
    course = tmp_path / "course"         # what a git clone would give: the tracked files of this checkout
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():
            (course / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, course / rel)
    run = textwrap.dedent(f"""
        import nbformat, nbclient
        nb = nbformat.read({str(ROOT / 'notebooks' / '00_start_here.ipynb')!r}, as_version=4)
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
        print("SETUP:", "".join(o.get("text", "") for o in nb.cells[1].outputs).strip())
        print("CELLS:", sum(c.cell_type == "code" for c in nb.cells))
    """)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"} and
           not k.startswith("ZEROEDU_")}
    env.update(HOME=str(tmp_path), ZEROEDU_SOURCE=str(course), PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    t0 = time.monotonic()
    proc = subprocess.run([py, "-c", run], capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"zeroedu installed from {course} into {course}, beside torch {MATRIX_TORCH}" in proc.stdout, proc.stdout
    after = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert after == before, (before, after)
    print(f"fresh venv {before.split()[-1]}, torch {before.split()[0]}: notebook 00 ran in "
          f"{time.monotonic() - t0:.0f} s (measured under load)")
