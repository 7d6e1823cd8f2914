"""Shared test hygiene.

- A test module that calls zeroedu.initialize() in the pytest process itself makes that process a world of one
  (torch.distributed's default group); the next module (test_launch checks that a launch leaves the caller's
  process untouched) must not inherit it.
- The slow tier: `make test-fast` (-m "not slow") leaves out the tests listed in SLOW_TESTS and SLOW_FIXTURES;
  `make test` and CI run them all.
- Under CI (CI=true, as GitHub Actions and .ci/run set it) a test that would skip because the grader's sandbox
  (bubblewrap) or the browser (Chromium, playwright, JupyterLab) is missing fails instead: .ci/run installs them,
  so a skip there means CI did not test what it claims to.
"""

from __future__ import annotations

import os
import re

import pytest
import torch.distributed as dist

# Skip reasons that name what .ci/run installs (tests/test_grading.py's needs_sandbox, tests/test_browser.py).
CI_INSTALLS = re.compile(r"bubblewrap|bwrap|Chromium|playwright|JupyterLab", re.IGNORECASE)


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def ci_must_fail(reason: str) -> bool:
    """A skip with this reason is a failure under CI."""
    return on_ci() and bool(CI_INSTALLS.search(reason))


# The slow tier, chosen by measuring: pytest --durations=0 file by file on 6 December 2026, under heavy load (8
# engineers on 2 cores), so only the ranking counts; the listed tests took 5 s or more of setup + call there. One
# quick test of each area stays in the fast tier. A test id covers all its parameters. tests/test_ci.py checks that
# every entry still names a test, so a renamed test cannot slip back into the fast tier.
SLOW_TESTS = [
    "tests/test_launch.py::test_fn_defined_in_main",                # a fresh interpreter imports torch, twice
    "tests/test_launch.py::test_ranks_die_with_a_killed_parent",
    "tests/test_checkpoint.py::test_disk_full_during_save_names_the_bytes_and_removes_the_partial_folder",
    "tests/test_offload.py::test_no_space_left_fails_before_training",
    "tests/test_offload.py::test_killed_during_nvme_step_next_run_starts_clean",
    "tests/test_tour.py::test_tour_matches_theory",
    "tests/test_tour.py::test_bench_runs_every_stage_against_its_peer",
]
# Files whose expensive module fixture trains every configuration in one launch: the tests that use it are slow.
SLOW_FIXTURES = {
    "tests/test_checkpoint.py": "saved",      # 131 s: saves every stage at every world size
    "tests/test_offload.py": "results",       # 29 s
    "tests/test_zeropp.py": "results",        # 27 s
}


def is_slow(nodeid: str, fixturenames: list[str]) -> bool:
    path = nodeid.split("::")[0]
    return (any(nodeid == s or nodeid.startswith(s + "[") for s in SLOW_TESTS)
            or SLOW_FIXTURES.get(path) in fixturenames)


@pytest.hookimpl(tryfirst=True)   # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item.nodeid, getattr(item, "fixturenames", [])):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if ci_must_fail(reason):
            report.outcome = "failed"
            report.longrepr = (f"CI=true and this test would skip: {reason}. .ci/run installs the sandbox and the "
                               "browser (scripts/install_bwrap.sh, scripts/install_chromium.sh); CI must run it.")
