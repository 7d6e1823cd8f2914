"""Shared test hygiene.

- A test module that calls zeroedu.initialize() in the pytest process itself makes that process a world of one
  (torch.distributed's default group); the next module (test_launch checks that a launch leaves the caller's
  process untouched) must not inherit it.
- The slow tier: `make test-fast` (-m "not slow") leaves out the tests listed in SLOW_TESTS and SLOW_FIXTURES;
  `make test` and CI run them all.
- Under CI (CI=true, as GitHub Actions and .ci/run set it) a test that would skip because the grader's sandbox
  (bubblewrap) or the browser (Chromium, playwright, JupyterLab) is missing fails instead: .ci/run installs them,
  so a skip there means CI did not test what it claims to.
- `wrong_answer_class`: the wrong-answer fixtures graded once as a class, for test_grading and test_kit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

# Skip reasons that name what .ci/run installs (tests/test_grading.py's needs_sandbox, tests/test_browser.py).
CI_INSTALLS = re.compile(r"bubblewrap|bwrap|Chromium|playwright|JupyterLab", re.IGNORECASE)


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def ci_must_fail(reason: str) -> bool:
    """A skip with this reason is a failure under CI."""
    return on_ci() and bool(CI_INSTALLS.search(reason))


# The slow tier, chosen by measuring: pytest --durations=0 file by file on 6 December 2026, under heavy load (8
# engineers on 2 cores), so only the ranking counts; the listed tests took about 8 s or more of setup + call there.
# A quick test of each area stays in the fast tier (stages: the 2-rank runs). A test id covers all its parameters;
# an id with "[" is a prefix of parametrized ids. tests/test_ci.py checks that every entry still names a test, so a
# renamed test cannot slip back into the fast tier.
SLOW_TESTS = [
    "tests/test_launch.py::test_fn_defined_in_main",                # a fresh interpreter imports torch, twice
    "tests/test_launch.py::test_ranks_die_with_a_killed_parent",
    "tests/test_checkpoint.py::test_disk_full_during_save_names_the_bytes_and_removes_the_partial_folder",
    "tests/test_offload.py::test_no_space_left_fails_before_training",
    "tests/test_offload.py::test_killed_during_nvme_step_next_run_starts_clean",
    "tests/test_tour.py::test_tour_matches_theory",
    "tests/test_tour.py::test_bench_runs_every_stage_against_its_peer",
    "tests/test_stages.py::test_matches_torch_ddp_and_zero_redundancy_optimizer[1]",
    "tests/test_stages.py::test_matches_torch_ddp_and_zero_redundancy_optimizer[4]",
    "tests/test_stages.py::test_world_of_one_without_launch",
    "tests/test_stages.py::test_stage3_backward_reduces_and_gathers_in_shared_rounds_with_the_same_result",
    "tests/test_stages.py::test_mixed_precision_tracks_reference[N2-fp16",
    "tests/test_course.py::test_train_matches_one_process_with_torch_adam",
    "tests/test_course.py::test_local_engine_holds_16_bytes_per_parameter",
    "tests/test_course_big.py::test_tinygpt_inside_init_equals_tinygpt_built_whole",
    # the grader end to end: each grades notebooks in fresh kernels (about 27 s a notebook under load; their own
    # timeouts are 300-1500 s); test_a_100_mb_error... and the sandbox's own tests keep it in the fast tier
    "tests/test_grading.py::test_every_solution_scores_full_marks",
    "tests/test_grading.py::test_every_exercise_stub_scores_zero_with_a_helpful_message",
    "tests/test_grading.py::test_wrong_answers_lose_their_points_with_a_hint",    # conftest.wrong_answer_class
    "tests/test_grading.py::test_deadlocked_ranks_are_ended_by_launch_not_by_the_kernel",
    "tests/test_grading_failures.py::test_gradebook_of_three_learners_one_hanging_one_crashing",
    "tests/test_grading.py::test_printing_megabytes_and_deleting_outside_files",
    "tests/test_grading.py::test_hostile_submissions_score_what_they_should_and_change_nothing_outside",
    "tests/test_grading_failures.py::test_rank_failures_keep_the_learners_line_and_name_the_rank_that_left_the_collective",
    "tests/test_grading.py::test_ten_correct_but_different_solutions_score_full_marks",
    "tests/test_grading.py::test_gradebook_counts_unreadable_as_zero_of_full_grades_the_newest_copy_and_refuses_links",
    "tests/test_grading.py::test_sandboxed_kernels_are_interrupted_and_killed_like_trusted_ones",   # 43 s
    # the grader end to end, measured on 6 December at 09:55-10:05 (load average 30-36, so only the ranking counts):
    # a whole class graded at once (249 s) and three anti-cheat gradings (39-74 s); test_a_100_mb_error... (66 s)
    # and test_a_rebound_harness... (28 s) keep a notebook graded in the fast tier
    "tests/test_grading.py::test_a_class_mixing_hostile_and_honest_learners_is_graded_whole_in_one_run",
    "tests/test_grading.py::test_ex04_step_that_ignores_the_clipping_coefficient_loses_the_hidden_test",
    "tests/test_grading.py::test_a_worker_thread_or_a_class_swap_earns_nothing_for_the_piece_to_write",
    "tests/test_grading.py::test_ex01_error_test_is_not_earned_by_raising_valueerror_on_everything",
    "tests/test_launch.py::test_a_folder_left_by_a_killed_launch_is_removed_by_the_next",           # 15 s
    "tests/test_launch.py::test_torchrun_two_nodes",                                    # one node stays fast
    "tests/test_launch.py::test_under_nohup_a_hangup_leaves_the_run_going",
    "tests/test_ci.py::test_a_missing_browser_skips_locally_and_fails_on_ci",
    "tests/test_ci.py::test_the_slow_list_names_tests_that_exist",
    # measured in a whole `.ci/run` on 6 December (11:39-12:10, quiet machine, nbval beside for its first 7 min):
    # `make test-fast` took 550 s, against its goal of 5 minutes; these took 5-31 s each there. The fast tier
    # keeps a graded notebook (test_a_rebound_harness...), a launch signal (SIGTERM), one translation check.
    "tests/test_kit_hints.py::test_self_grading_gives_the_next_hint_on_each_failure",              # 31 s
    "tests/test_grading.py::test_a_fork_bomb_and_a_memory_hog_score_0_beside_an_honest_learner_who_keeps_full_marks",
    "tests/test_grading.py::test_bytes_reported_by_rebound_collectives_or_a_forged_counter_score_0_next_to_honest_learners",
    "tests/test_grading.py::test_a_100_mb_error_at_the_top_of_a_cell_is_cut_in_the_kernel",        # 11 s
    "tests/test_grading.py::test_verdicts_and_refusals_forged_by_a_notebook_never_read_as_the_graders",
    "tests/test_translations.py::test_chinese_exercises_grade_as_the_english_ones",                # 17 s
    "tests/test_translations.py::test_a_changed_solution_or_a_hand_edited_chinese_exercise_is_caught",
    "tests/test_kit_messages.py::test_a_chinese_grading_run_says_why_in_chinese_and_the_report_still_names_the_mistakes",
    "tests/test_kit_release.py::test_a_release_notebook_answered_right_scores_full_marks_hidden_tests_included",
    "tests/test_launch.py::test_sigterm_to_a_rank_runs_its_cleanup_and_is_reported",                # 9 s
    "tests/test_launch.py::test_a_signal_to_the_parent_leaves_no_folder[SIGHUP]",
    "tests/test_launch.py::test_a_signal_to_the_parent_leaves_no_folder[SIGINT]",
    "tests/test_launch.py::test_a_script_piped_on_stdin_launches",
    "tests/test_launch.py::test_raw_dist_hang_is_named_within_hang_timeout[async-then-wait]",
    "tests/test_launch_shared_machine.py::test_a_stopped_rank_is_reported_stopped_with_its_stack",
    "tests/test_checkpointing.py::test_engine_meter_and_checkpointing_on_two_ranks",
    "tests/test_imports.py::test_launch_is_the_package_and_the_function",
    "tests/test_environment.py::test_make_picks_a_python_in_range_or_says_which_to_install",
    "tests/test_setup_cell.py::test_setup_cell_installs_from_a_wheel_and_the_same_kernel_imports_it",
]
# Files whose expensive module fixture trains many configurations in one launch: the tests that use it (with one
# of these parameters, or with any when None) are slow.
SLOW_FIXTURES: dict[str, tuple[str, set | None]] = {
    "tests/test_checkpoint.py": ("saved", None),     # 131 s: saves every stage at every world size
    "tests/test_offload.py": ("results", None),      # 29 s
    "tests/test_zeropp.py": ("results", None),       # 27 s
    "tests/test_stages.py": ("world", {1, 4}),       # 87 s and 38 s of setup; N2 (23 s) stays fast
    "tests/test_kit.py": ("graded", None),           # 24 s: grades a class of four (roster, LMS, feedback)
    "tests/test_memory_timeline.py": ("run", {3}),   # 16 s; stage 2 (5 s) stays fast
    "tests/test_gpu_run.py": ("dry", None),          # 8 s: the GPU script's dry run in a fresh interpreter
}


def is_slow(item) -> bool:
    nodeid = item.nodeid
    if any(nodeid == s or nodeid.startswith(s if "[" in s else s + "[") for s in SLOW_TESTS):
        return True
    fixture, params = SLOW_FIXTURES.get(nodeid.split("::")[0], (None, None))
    if fixture not in getattr(item, "fixturenames", ()):
        return False
    callspec = getattr(item, "callspec", None)
    return params is None or (callspec is not None and callspec.params.get(fixture) in params)


@pytest.hookimpl(tryfirst=True)   # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


@dataclass
class GradedClass:
    """One `zeroedu grade` run over a class folder: its process, its --json gradebook by (learner, exercise), and
    its misconception report in English and Chinese."""
    proc: subprocess.CompletedProcess
    results: dict[tuple[str, str], dict]
    report_en: str
    report_zh: str


def _grade_class(tmp: Path, edition: str) -> GradedClass:
    """Every wrong-answer fixture of test_grading.WRONG applied to the `edition` ("en", "zh") exercise notebook and
    handed in by its own learner (the folder is the fixture's name), graded at once as an instructor grades a
    class: `zeroedu grade --trusted --jobs 2 --json --report`, at the grader's default cell limit (120 s; a
    launch gets 90 s and a wait in one collective 45 s: a shorter limit has called a slow rank on a loaded
    machine hung). No language setting of this process reaches the grader: each notebook speaks its own."""
    from test_grading import WRONG, make_submission

    subs = tmp / "subs"
    for fixture, (exercise, _) in WRONG.items():
        make_submission(exercise, fixture, subs / fixture.removesuffix(".cells"), edition=edition)
    book, report = tmp / "gradebook.json", tmp / "report.md"
    env = {k: v for k, v in os.environ.items() if k != "ZEROEDU_LANG"}
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(subs), "--trusted", "--quiet", "--jobs", "2",
                           "--json", str(book), "--report", str(report)],
                          capture_output=True, text=True, timeout=880, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {(learner["learner"], e["exercise"]): e for learner in json.loads(book.read_text())["learners"]
               for e in learner["exercises"]}
    return GradedClass(proc, results, report.read_text(encoding="utf-8"),
                       (tmp / "report.zh.md").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def wrong_answer_class(tmp_path_factory) -> GradedClass:
    """The English class (_grade_class), graded once: test_grading checks each learner's points and hints from
    its gradebook, test_kit the misconception report of the same run."""
    return _grade_class(tmp_path_factory.mktemp("wrong-class"), "en")


@pytest.fixture(scope="session")
def wrong_answer_class_zh(tmp_path_factory) -> GradedClass:
    """The same mistakes handed in on the Chinese exercise notebooks (notebooks/zh/exercises/): a class that
    learns in 中文, whose hints and report test_kit and test_kit_messages read."""
    return _grade_class(tmp_path_factory.mktemp("wrong-class-zh"), "zh")


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
