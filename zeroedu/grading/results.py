"""What grading passes around and hands back: a test's result, an exercise's result, one cell's run, and the
limits a notebook runs under."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TestResult:
    grade_id: str
    name: str
    points: float
    max_points: float
    passed: bool
    message: str = ""
    hidden: bool = False


@dataclass
class ExerciseResult:
    learner: str
    exercise: str
    path: str
    status: str = "graded"     # graded | not submitted | unknown exercise | unreadable | refused
    points: float = 0.0
    max_points: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    sha256: str = ""           # of the submission as handed in (the grader graded a copy)
    language: str = "en"       # of its check names, hints and notes: the notebook's (zeroedu.language), or the grader's

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def first_failure(self) -> str:
        if self.status != "graded":
            return self.notes[0] if self.notes else self.status
        failed = next((t for t in self.tests if not t.passed), None)
        return f"{failed.name}: {failed.message}" if failed else ""


@dataclass
class CellRun:
    status: str                 # ok | error | timeout | killed | died | skipped | not run
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0


@dataclass
class Limits:
    cell_timeout: float = 120.0
    notebook_timeout: float = 900.0
    max_output: int = 1_000_000
