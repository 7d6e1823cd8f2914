"""zeroedu: DeepSpeed ZeRO stages 0-3, offload and ZeRO++, small enough to read, measured as it runs.

The API names load on first use, so `import zeroedu.theory` (closed forms), `zeroedu doctor` and `zeroedu plan`
run without importing torch. Modules that moved into packages keep their old paths (zeroedu._aliases).
"""

import importlib
import importlib.util

from zeroedu import _aliases
from zeroedu._version import __version__
from zeroedu.i18n import lang

_aliases.install()

__all__ = ["Config", "ConfigError", "grade", "initialize", "lang", "launch", "load_config", "progress", "__version__"]


def grade(notebook=None, *, sandbox: bool = False) -> int:
    """Grade an exercise notebook from a cell in it (default: this notebook, as last saved): each test's verdict and
    hint, then the score. Your own notebook runs without the sandbox (zeroedu.course.selfgrade)."""
    from zeroedu.course.selfgrade import grade as _grade

    return _grade(notebook, sandbox=sandbox)


def progress(course=None) -> None:
    """Print which lessons you have run and which exercises pass (zeroedu.course.progress)."""
    from zeroedu.course.progress import main as _progress

    _progress([] if course is None else [str(course)])


_API = {"initialize": "zeroedu.compose", "Config": "zeroedu.config", "ConfigError": "zeroedu.config",
        "load_config": "zeroedu.config"}

_TORCH_FIX = ("zeroedu needs torch, which is not installed in this environment. Install the pinned CPU build: "
              "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (or `make "
              ".venv/.installed`); `zeroedu doctor` checks the rest.")


def __getattr__(name: str):
    # launch is the package zeroedu/launch/, callable as the function (zeroedu._aliases.callable_module).
    if name.startswith("__"):   # probes such as __path__ or __wrapped__ are not submodules
        raise AttributeError(f"module 'zeroedu' has no attribute {name!r}")
    module_name = _API.get(name) or _aliases.new_name(f"zeroedu.{name}") or (
        f"zeroedu.{name}" if name == "launch" or importlib.util.find_spec(f"zeroedu.{name}") else None)
    if module_name is None:
        raise AttributeError(f"module 'zeroedu' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as missing:
        # Without torch, what fails first may be another package installed with it (cloudpickle): name torch.
        if missing.name != "torch" and importlib.util.find_spec("torch") is not None:
            raise
        raise ImportError(f"zeroedu.{name}: {_TORCH_FIX}") from missing
    value = getattr(module, name) if name in _API else module
    globals()[name] = value
    return value
