"""environment.yml (conda users) and pyproject.toml (pip users) must describe the same environment.

The comparison is written here, independently of zeroedu: tomllib reads pyproject.toml, PyYAML reads
environment.yml (PyYAML is always present: jupyterlab -> jupyter_server -> jupyter_events requires it), and
`packaging` (a JupyterLab dependency) compares the version specifiers. Specifiers must be *equal* as sets of
clauses, not merely overlap: "the same packages with compatible pins" is easiest to keep true when the pins are
literally the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: the test extra installs tomli, tomllib's origin
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGES = {"python", "pip"}  # conda entries with no counterpart in pyproject's dependency lists


def load_pyproject(text: str | None = None) -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text() if text is None else text)


def load_environment(text: str | None = None) -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text() if text is None else text)


def pyproject_requirements(pyproject: dict) -> dict[str, Requirement]:
    """Runtime dependencies plus the test extra (the yml is the whole course environment, tests included), those
    that apply on the yml's Python, 3.11 (tomli is for Python 3.10 only)."""
    project = pyproject["project"]
    texts = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))
    reqs = [r for r in map(Requirement, texts) if r.marker is None or r.marker.evaluate({"python_version": "3.11"})]
    return {canonicalize_name(r.name): r for r in reqs}


def conda_requirement(spec: str) -> Requirement:
    """A conda-forge MatchSpec written in pip syntax ("numpy>=2.0,<3"). conda-only forms (fuzzy "=1.2",
    build strings, "|") would not mean the same to pip, so they are rejected with the reason."""
    if re.search(r"(?<![<>=!~])=(?!=)", spec) or "|" in spec or " " in spec.strip():
        raise ValueError(f"environment.yml entry {spec!r} uses conda-only syntax; write it as pip would "
                         "(name>=x,<y or name==x) so that it can be compared with pyproject.toml")
    return Requirement(spec)


def environment_requirements(env: dict) -> tuple[dict[str, Requirement], dict[str, Requirement], list[str]]:
    """(conda requirements, pip-section requirements, pip-section option and editable lines)."""
    conda: dict[str, Requirement] = {}
    pip: dict[str, Requirement] = {}
    pip_other: list[str] = []
    for entry in env["dependencies"]:
        if isinstance(entry, dict):
            for line in entry["pip"]:
                if line.startswith("-"):
                    pip_other.append(line)
                else:
                    req = Requirement(line)
                    pip[canonicalize_name(req.name)] = req
        elif entry.split("=")[0].split("<")[0].split(">")[0].strip() not in NOT_PACKAGES:
            req = conda_requirement(entry)
            conda[canonicalize_name(req.name)] = req
    return conda, pip, pip_other


def default_torch(pyproject: dict) -> Requirement:
    """torch==<[tool.zeroedu] tested-torch>: the package accepts a range, the course's environment (make, conda)
    installs the version its saved outputs were made with."""
    return Requirement(f"torch=={pyproject['tool']['zeroedu']['tested-torch']}")


def disagreements(pyproject: dict, env: dict) -> list[str]:
    """Every way the two files disagree, as sentences; empty when they agree. torch: environment.yml pins the
    tested version, which must lie in pyproject.toml's range."""
    wanted = pyproject_requirements(pyproject)
    pin = default_torch(pyproject)
    if not wanted["torch"].specifier.contains(str(pin.specifier).lstrip("=")):
        return [f"tested-torch {pin.specifier} is outside pyproject.toml's torch range {wanted['torch'].specifier}"]
    wanted["torch"] = pin
    conda, pip, _ = environment_requirements(env)
    problems = [f"{name} is in both the conda list and the pip section of environment.yml"
                for name in sorted(conda.keys() & pip.keys())]
    provided = {**conda, **pip}
    for name, req in sorted(wanted.items()):
        if name not in provided:
            problems.append(f"{name} ({req}) is in pyproject.toml but not in environment.yml")
        elif SpecifierSet(str(provided[name].specifier)) != SpecifierSet(str(req.specifier)):
            problems.append(f"{name}: pyproject.toml says {req.specifier or 'any'}, environment.yml says "
                            f"{provided[name].specifier or 'any'}")
    problems += [f"{name} ({req}) is in environment.yml but not in pyproject.toml"
                 for name, req in sorted(provided.items()) if name not in wanted]
    return problems


# -- the checks ----------------------------------------------------------------------------------------------

def test_pins_agree():
    assert disagreements(load_pyproject(), load_environment()) == []


def test_disagreements_are_found():
    """The comparison must be able to fail: each kind of drift, made on purpose, is reported."""
    pyproject, env_text = load_pyproject(), (ROOT / "environment.yml").read_text()
    cases = {  # regex of the sentence expected -> environment.yml with that drift
        r"numpy: pyproject.toml says .*environment.yml says .*1\.26": env_text.replace("numpy>=2.0,", "numpy>=1.26,"),
        r"tqdm .* is in pyproject.toml but not in environment.yml": env_text.replace("  - tqdm>=4.66,<5\n", ""),
        r"scipy .* is in environment.yml but not in pyproject.toml":
            env_text.replace("  - pip\n", "  - pip\n  - scipy>=1.13\n"),
        r"torch: pyproject.toml says ==2.13.0, environment.yml says ==2.12.0":
            env_text.replace("torch==2.13.0", "torch==2.12.0"),
        r"cloudpickle is in both": env_text.replace("      - -e .", "      - cloudpickle>=3.0,<4\n      - -e ."),
    }
    for expected, text in cases.items():
        assert text != env_text, f"the case {expected!r} no longer edits environment.yml: update the test"
        found = disagreements(pyproject, load_environment(text))
        assert any(re.search(expected, p) for p in found), (expected, found)
    with pytest.raises(ValueError, match="conda-only syntax"):
        conda_requirement("numpy=2.0")


def test_environment_shape():
    env = load_environment()
    assert env["name"] == "zeroedu"
    assert env["channels"] == ["conda-forge"]
    conda, pip, other = environment_requirements(env)
    # torch only from pip, pinned exactly as pyproject pins it; a conda `pytorch` would be a second torch
    torch_pin = default_torch(load_pyproject()).specifier
    assert str(pip["torch"].specifier) == str(torch_pin) and str(torch_pin).startswith("==")
    assert not {"torch", "pytorch"} & conda.keys()
    # the CPU wheel by default, and the course itself installed editable
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in other
    assert "-e ." in other


def test_python_versions_agree():
    """conda's `python=3.11` (3.11.*, the tested default) lies inside requires-python, and requires-python admits
    3.10 to 3.14, every Python the supported torch releases ship wheels for, and nothing outside."""
    env_python = [e for e in load_environment()["dependencies"] if isinstance(e, str) and e.startswith("python")]
    assert env_python == ["python=3.11"], env_python
    pip_says = SpecifierSet(load_pyproject()["project"]["requires-python"])
    for v in ["3.11.0", "3.11.7", "3.11.99"]:
        assert Version(v) in pip_says, v
    for v, admitted in [("3.9.18", False), ("3.10.0", True), ("3.12.1", True), ("3.13.0", True), ("3.14.2", True),
                        ("3.15.0", False)]:
        assert (Version(v) in pip_says) == admitted, v


# -- a fresh venv installs the pip section ----------------------------------------------------------------------

NETWORK_ERRORS = re.compile(r"NewConnectionError|Network is unreachable|Temporary failure in name resolution|"
                            r"Name or service not known|ConnectTimeout|ReadTimeout|Max retries exceeded|"
                            r"No route to host|Connection refused", re.I)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fresh_venv_installs_pip_section(tmp_path):
    """`conda env create` ends by running pip on the yml's pip section inside the new environment. Here: a fresh
    Python 3.11 venv, and a real `pip install` of exactly those lines, options included (the CPU index too).

    What it proves: each pinned line names a wheel that installs on this Python and platform, torch comes as the
    CPU build on Linux without an NVIDIA GPU (never an explicit CUDA build), playwright's wheel brings its own
    driver (no download), and the course installs editable with its `zeroedu` command. --no-deps: on conda the
    dependencies come from the conda list (checked against pyproject.toml above); resolving them again here would
    re-download what conda provides. About a minute, most of it unpacking torch.
    Skips (does not fail) when pip reports that it cannot reach any package index.
    """
    _, pip_reqs, other = environment_requirements(load_environment())
    # the course's source, copied so that the editable install writes nothing into the work tree
    src = tmp_path / "src"
    shutil.copytree(ROOT / "zeroedu", src / "zeroedu", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp_path / "venv"
    # --without-pip: ensurepip would add ~20 s; the test venv's own pip installs into it via --python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    args: list[str] = []
    for line in other:   # "--extra-index-url URL", "-e ."
        flag, _, value = line.partition(" ")
        args += [flag, str(src) if value == "." else value]
    args += [str(r) for r in pip_reqs.values()]
    # --retries 0 --timeout 10: an index this machine cannot reach costs seconds, then pip goes on with the others
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
           "--no-compile", "--retries", "0", "--timeout", "10", *args]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and NETWORK_ERRORS.search(output):
        pytest.skip(f"no package index reachable (offline?): {NETWORK_ERRORS.search(output).group(0)}")
    assert proc.returncode == 0, f"pip could not install environment.yml's pip section:\n{output[-3000:]}"

    # what got installed, read from the fresh venv itself
    probe = textwrap.dedent("""
        import importlib.metadata as m, importlib.util, json, pathlib
        pw = pathlib.Path(importlib.util.find_spec("playwright").origin).parent
        print(json.dumps({"versions": {d.metadata["Name"].lower(): d.version for d in m.distributions()},
                          "zeroedu": importlib.util.find_spec("zeroedu").origin,
                          "driver": [p.name for p in (pw / "driver").iterdir()]}))
    """)
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    seen = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                                     check=True, timeout=60, cwd=tmp_path, env=clean).stdout)
    versions = {canonicalize_name(k): v for k, v in seen["versions"].items()}
    for name, req in pip_reqs.items():
        assert name in versions, f"{req} did not install"
        assert req.specifier.contains(versions[name], prereleases=True), (req, versions[name])
    assert versions["zeroedu"] == load_pyproject()["project"]["version"]
    assert seen["zeroedu"] == str(src / "zeroedu" / "__init__.py")       # editable: the source folder itself
    assert (venv / "bin" / "zeroedu").is_file()                          # the `zeroedu` command
    assert "node" in seen["driver"] or "node.exe" in seen["driver"], seen["driver"]  # playwright's own driver
    torch_version = versions["torch"]
    assert "+cu" not in torch_version, torch_version
    cpu_index_down = CPU_INDEX.split("/whl")[0].split("//")[1] in output and NETWORK_ERRORS.search(output)
    if sys.platform.startswith("linux") and not shutil.which("nvidia-smi") and not cpu_index_down:
        assert torch_version.endswith("+cpu"), f"torch {torch_version}: the CPU build was offered but not taken"


# -- the Makefile's torch: the build this machine can use ----------------------------------------------------------

@pytest.mark.timeout(120)
def test_install_torch_picks_the_cpu_build_without_an_nvidia_gpu():
    """scripts/install_torch.py --dry-run (what `make .venv/.installed` runs, minus the install): the pin comes from
    pyproject.toml; on Linux without nvidia-smi the plan is the CPU build; ZEROEDU_TORCH_INDEX overrides."""
    script = str(ROOT / "scripts" / "install_torch.py")
    pin = str(default_torch(load_pyproject()))
    env = {k: v for k, v in os.environ.items() if k != "ZEROEDU_TORCH_INDEX"}
    proc = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reason, command = proc.stdout.strip().splitlines()
    assert reason.startswith(f"install_torch: {pin} (") and command.startswith(f"pip install {pin}"), proc.stdout
    if sys.platform.startswith("linux") and not shutil.which("nvidia-smi"):
        if "cannot be reached" in reason:
            pytest.skip(f"neither a configured source nor {CPU_INDEX} offers the CPU build here: {reason}")
        assert "the CPU build" in reason, reason
        assert "+cpu" in reason or command.endswith(f"--extra-index-url {CPU_INDEX}"), proc.stdout
    mirror = "https://mirror.example/whl/cu126"
    chosen = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, timeout=30,
                            env={**env, "ZEROEDU_TORCH_INDEX": mirror})
    assert chosen.stdout.strip().splitlines()[-1] == f"pip install {pin} --extra-index-url {mirror}", chosen.stdout


# -- the Makefile's Python: one in the range, or a message that says which to install ------------------------------

def _make_copy(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "scripts/install_torch.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.timeout(600)
def test_make_picks_a_python_in_range_or_says_which_to_install(tmp_path):
    folder = _make_copy(tmp_path)
    dry = subprocess.run(["make", "-n", ".venv/.installed"], cwd=folder, capture_output=True, text=True, timeout=240)
    assert dry.returncode == 0, dry.stderr
    chosen = re.search(r"^(\S+) -m venv \.venv$", dry.stdout, re.M)
    assert chosen, dry.stdout
    version = subprocess.run([chosen.group(1), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert Version(version + ".0") in SpecifierSet(load_pyproject()["project"]["requires-python"]), version
    old = next(iter(sorted(Path.home().glob(".pyenv/versions/3.9*/bin/python3.9"))), None) or shutil.which("python3.9")
    if old is None:
        pytest.skip("no Python older than the range here to try")
    refused = subprocess.run(["make", f"PY={old}", ".venv/.installed"], cwd=folder, capture_output=True, text=True,
                             timeout=240)   # pyenv's shims answer slowly on a loaded machine
    assert refused.returncode != 0 and not (folder / ".venv").exists()
    assert "zeroedu needs Python 3.10 to 3.14" in refused.stdout and f"PY={old} is not in that range" in refused.stdout
    assert "install Python 3.11" in refused.stdout and "make PY=/path/to/python3.11 tour" in refused.stdout
