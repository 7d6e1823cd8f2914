"""CI cannot pass without the sandbox and the browser: under CI=true, a test that would skip for want of them
fails (tests/conftest.py), and .ci/run stops before the tests when its installers could not provide them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow   # two pytest processes: tens of seconds on a loaded machine
def test_a_missing_browser_skips_locally_and_fails_on_ci():
    args = ["tests/test_browser.py", "-rs"]
    local = _pytest(args, ZEROEDU_CHROMIUM="/nonexistent/chromium", CI="")
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout[-2000:]
    ci = _pytest(args, ZEROEDU_CHROMIUM="/nonexistent/chromium", CI="true")
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout[-2000:]   # it fails in setup, where it skipped
    assert "CI=true and this test would skip: no Chromium at /nonexistent/chromium" in ci.stdout


def test_the_rule_names_only_what_ci_installs(monkeypatch):
    from conftest import ci_must_fail

    monkeypatch.setenv("CI", "true")
    assert ci_must_fail("needs bubblewrap: bubblewrap (bwrap) is not installed")
    assert ci_must_fail("no Chromium at /usr/bin/chromium: run scripts/install_chromium.sh")
    assert not ci_must_fail("needs CUDA")            # the GPU tests still skip on CI's CPU machines
    monkeypatch.setenv("CI", "")
    assert not ci_must_fail("needs bubblewrap: bubblewrap (bwrap) is not installed")


def test_ci_run_stops_when_the_sandbox_is_missing(tmp_path):
    """.ci/run's check after the installers: with no bwrap on PATH it exits 1 and says so, before any test."""
    check = ROOT / ".ci" / "check_installed.sh"
    env = {**os.environ, "PATH": str(tmp_path), "ZEROEDU_CHROMIUM": "/bin/true"}
    done = subprocess.run(["/bin/sh", str(check)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "bubblewrap" in done.stdout + done.stderr, done
    env = {**os.environ, "ZEROEDU_CHROMIUM": "/nonexistent/chromium"}
    done = subprocess.run(["/bin/sh", str(check)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Chromium" in done.stdout + done.stderr, done


@pytest.mark.slow   # collects the whole suite: every test module is imported
def test_the_slow_list_names_tests_that_exist():
    from conftest import SLOW_FIXTURES, SLOW_TESTS

    # One collection (a whole one takes tens of seconds): the tests marked slow are tests that exist, so an entry
    # that names none of them is stale or unmarked.
    slow = _pytest(["--collect-only", "-m", "slow", "tests"])   # _pytest adds -q: one node id a line
    ids = [line for line in slow.stdout.splitlines() if "::" in line]
    counts = re.search(r"(\d+)/(\d+) tests collected", slow.stdout)
    assert counts and int(counts[2]) > 500 and len(ids) == int(counts[1]), slow.stdout[-2000:]
    stale = [s for s in SLOW_TESTS if not any(i == s or i.startswith(s if "[" in s else s + "[") for i in ids)]
    assert not stale, f"tests/conftest.py's SLOW_TESTS names tests that do not exist or are not marked slow: {stale}"
    for path, (fixture, _) in SLOW_FIXTURES.items():
        assert fixture in (ROOT / path).read_text(), f"{path} no longer has the fixture {fixture}"


def _make_variable(name: str) -> list[str]:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} :="):
            return line.split(":=", 1)[1].split()
    raise AssertionError(f"the Makefile has no {name}")


def test_the_notebooks_nbval_runs_once_never_import_torch_or_numpy():
    """The kernel-set variables (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) choose torch's
    kernels; a notebook that runs with torch and numpy blocked computes with Python floats only, so its outputs
    cannot depend on them and `make nbval` runs it under the native set alone (NBVAL_KERNEL_FREE)."""
    listed = _make_variable("NBVAL_KERNEL_FREE")
    assert listed, "NBVAL_KERNEL_FREE is empty: drop it from the Makefile instead"
    runner = textwrap.dedent("""
        import json, sys
        sys.modules["torch"] = None     # import torch (or numpy) now raises ImportError
        sys.modules["numpy"] = None
        cells = json.load(open(sys.argv[1], encoding="utf-8"))["cells"]
        scope = {"__name__": "__main__"}
        for cell in cells:
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), sys.argv[1], "exec"), scope)
        print("ran without torch")
    """)
    for notebook in listed:
        done = subprocess.run([sys.executable, "-c", runner, str(ROOT / notebook)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0 and "ran without torch" in done.stdout, (notebook, done.stderr[-2000:])


def test_a_notebook_that_trains_is_not_run_once():
    """The converse, on a notebook that certainly needs torch: it fails with torch blocked, so the check above
    can fail, and it is not in NBVAL_KERNEL_FREE."""
    assert "notebooks/03_stage0_ddp.ipynb" not in _make_variable("NBVAL_KERNEL_FREE")
    code = ("import sys; sys.modules['torch'] = None\nimport json\n"
            "cells = json.load(open('notebooks/03_stage0_ddp.ipynb'))['cells']\n"
            "code = [c for c in cells if c['cell_type'] == 'code'\n"
            "        and 'zeroedu-setup' not in c['metadata'].get('tags', [])]\n"
            "exec(''.join(code[0]['source']), {})")   # its first cell after the hosted-setup cell
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0 and "torch" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("foreground, background, ok", [
    ("echo tests passed", "echo notebooks passed", True),
    ("echo tests failed; exit 3", "echo notebooks passed", False),
    ("echo tests passed", "echo notebooks failed; exit 2", False),
])
def test_make_test_runs_nbval_beside_pytest_and_fails_if_either_fails(tmp_path, foreground, background, ok):
    """`make test` runs nbval beside pytest through .ci/beside: the run beside writes to its log, which is printed
    after the foreground's output, and the exit status is non-zero when either command failed."""
    log = tmp_path / "deep" / "nbval.log"
    done = subprocess.run(["bash", str(ROOT / ".ci" / "beside"), str(log), f"sleep 0.3; {background}", foreground],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == ok, (done.returncode, done.stdout, done.stderr)
    lines = done.stdout.splitlines()   # whole lines: the header lines quote both commands
    assert log.read_text().strip() == background.split(";")[0].removeprefix("echo ")
    assert lines.index(foreground.split(";")[0].removeprefix("echo ")) < lines.index(log.read_text().strip()), lines
    assert "bash .ci/beside" in (ROOT / "Makefile").read_text()


def test_make_test_runs_every_test_file_in_one_of_its_two_streams():
    """`make test`'s two streams: the foreground pytest leaves out exactly the files that the stream beside runs
    after nbval (PYTEST_BESIDE), so every test file runs once. Read from the Makefile's text (`make -n` would run
    the recipe: a line with $(MAKE) in it runs even then)."""
    text = (ROOT / "Makefile").read_text()
    beside = re.search(r"^PYTEST_BESIDE := (.+)$", text, re.M).group(1).split()
    assert beside and all((ROOT / f).is_file() and f.startswith("tests/test_") for f in beside), beside
    recipe = text[text.index("\ntest: "):text.index("\nendif", text.index("\ntest: "))]
    assert "pytest -q -p no:cacheprovider $(PYTEST_BESIDE)" in recipe, recipe      # beside, after nbval
    assert "pytest -q $(addprefix --ignore=,$(PYTEST_BESIDE)) tests" in recipe, recipe   # the rest, here
    assert recipe.index("nbval NBVAL_ISAS") < recipe.index("$(PYTEST_BESIDE) ||"), recipe
