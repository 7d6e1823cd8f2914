"""The engine in two files: zeroedu/engine/__init__.py is the ZeRO step, zeroedu/engine/facade.py the surface that
scripts written for DeepSpeed call. The facade is checked against DeepSpeed 0.19.8's own DeepSpeedEngine class
(every public name it defines is one DeepSpeed's engine has, or a listed zeroedu addition), and the step file
against the facade (it defines none of those names), read from the source with `ast`."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "zeroedu" / "engine"
# Names on the facade that DeepSpeed's engine object does not have, each with where DeepSpeed has it instead.
ZEROEDU_ADDITIONS = {"log_summary": "deepspeed.comm.log_summary()"}


def defined(path: Path, cls: str) -> set[str]:
    """The public methods and properties class `cls` defines in `path` (its own, not inherited)."""
    tree = ast.parse(path.read_text(), str(path))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.name for n in body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def test_the_step_file_defines_none_of_the_facades_names():
    facade = defined(ENGINE / "facade.py", "DeepSpeedFacade")
    step = defined(ENGINE / "__init__.py", "Engine")
    assert {"save_checkpoint", "get_lr", "no_sync", "state_dict"} <= facade, facade
    assert {"forward", "backward", "step", "wait", "publish"} <= step, step
    assert not facade & step, f"defined in both files (the step's copy hides the facade's): {sorted(facade & step)}"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_every_facade_name_is_one_deepspeeds_engine_has():
    from deepspeed.runtime.engine import DeepSpeedEngine

    source = inspect.getsource(DeepSpeedEngine)   # counters such as global_steps are set in its __init__

    def has(name: str) -> bool:
        return hasattr(DeepSpeedEngine, name) or f"self.{name} = " in source

    facade = defined(ENGINE / "facade.py", "DeepSpeedFacade")
    missing = sorted(n for n in facade - ZEROEDU_ADDITIONS.keys() if not has(n))
    assert not missing, f"not on deepspeed's DeepSpeedEngine (move them to the step file, or list them): {missing}"
    for name in ZEROEDU_ADDITIONS:
        assert not has(name), f"{name} is DeepSpeed's engine's now: drop it from the list"


def test_old_imports_give_one_engine_with_both_halves():
    import zeroedu
    from zeroedu.engine import Engine, facade
    from zeroedu.engine.facade import DeepSpeedFacade

    assert issubclass(Engine, DeepSpeedFacade) and facade.DeepSpeedFacade is DeepSpeedFacade
    assert zeroedu.engine.Engine is Engine
    for name in ("save_checkpoint", "get_lr", "no_sync", "forward", "step", "group_decay"):
        assert callable(getattr(Engine, name)), name


def test_the_facade_and_the_step_report_use_only_the_steps_public_names():
    """Both sit beside the step and reach it as an extra does (tests/test_protocol.py's rule): the report once kept
    positions into the engine's private marks, which trimming shifted (issue 33's `_marks` bug)."""
    from test_protocol import core_privates, touches

    privates = core_privates()
    assert {"_phase", "_tracker"} <= privates
    for name in ("facade.py", "report.py"):
        assert not touches(ENGINE / name, privates), touches(ENGINE / name, privates)
