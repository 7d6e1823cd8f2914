# The two commands in README.md: `make tour` and `make test`. Each builds .venv first if needed.
# `make help` lists the targets and the test tiers.
# Python: the first of these that is in zeroedu's range (pyproject.toml requires-python, 3.10 to 3.14); 3.11 first,
# the tested default. `make PY=/path/to/python3.12 tour` picks one yourself.
PY_CANDIDATES := python3.11 python3.12 python3.13 python3.10 python3.14 python3
PY_IN_RANGE := import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] < (3, 15)))
PY ?= $(firstword $(foreach p,$(PY_CANDIDATES),$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c '$(PY_IN_RANGE)' 2>/dev/null && echo $(p))))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help tour test test-fast ci lint nbval nbval-matrix test-matrix exercises book slides zh-status clean

$(STAMP): pyproject.toml scripts/install_torch.py
	@if [ -z "$(PY)" ] || ! $(PY) -c '$(PY_IN_RANGE)' 2>/dev/null; then \
	  echo "zeroedu needs Python 3.10 to 3.14 (the Pythons torch ships wheels for; 3.11 is the tested default)."; \
	  echo "Found:$(if $(PY), PY=$(PY) is not in that range;)"; \
	  for p in $(PY_CANDIDATES); do v=$$($$p --version 2>/dev/null) && echo "  $$p: $$v at $$(command -v $$p)"; done; \
	  echo "Fix: install Python 3.11 (Debian/Ubuntu: sudo apt install python3.11 python3.11-venv; macOS: brew install python@3.11;"; \
	  echo "     any system: pyenv install 3.11), then run make again, or point make at one: make PY=/path/to/python3.11 tour"; \
	  exit 1; fi
	@echo "Python for .venv: $(PY) ($$($(PY) --version 2>&1))"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, and the CPU build unless an NVIDIA GPU is there to use (Linux: PyPI's wheel is the
	# CUDA build); installed before the rest so that no other package can ask for a build of its own.
	$(BIN)/python scripts/install_torch.py
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

help:
	@echo "make tour        the course's tour: every stage's bytes against theory (builds .venv first)"
	@echo "make test-fast   the edit loop: ruff + pytest without nbval and the slow tests (its goal: under 5 min on 2 cores)"
	@echo "make test        what CI runs: ruff + every test + nbval over every notebook, in two streams"
	@echo "                 (pytest | nbval, then PYTEST_BESIDE; NBVAL_BESIDE=0: one after the other)"
	@echo "make ci          make test with nbval under each kernel set of NBVAL_MATRIX ($(NBVAL_MATRIX)), as .ci/run"
	@echo "make nbval       the notebooks alone; make nbval-matrix: under each kernel set"
	@echo "make lint | exercises | book | slides | zh-status | test-matrix | clean"

tour: $(STAMP)
	$(BIN)/zeroedu tour

# The Chinese edition (notebooks/zh/) is not run again: it has the English code cells, and its saved text outputs
# equal the English ones (tests/test_translations.py), so nbval over it would check the same thing twice.
NOTEBOOKS := $(wildcard notebooks/*.ipynb solutions/*.ipynb)

# CPU kernel sets for nbval. What nbval compares (bytes, counts, verdicts) must not depend on them; floats that do
# are printed with viz.approx and masked (tests/nbval_sanitize.cfg). native: the best this CPU has; default: no
# SIMD kernels at all; avx2: an AVX2 machine's kernels, on a CPU that also has AVX-512.
ISA_native :=
ISA_default := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
ISA_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
NBVAL_ISAS ?= native
# The portability matrix CI runs, defined here only: the saved outputs must hold under the native kernels and none.
NBVAL_MATRIX := native default
# Notebooks whose kernel never imports torch or numpy (tests/test_ci.py runs them with both blocked): the kernel
# sets above choose torch's kernels only, so these run under the native set alone. Every other notebook trains or
# computes with torch and runs under each set.
NBVAL_KERNEL_FREE := solutions/ex09_choose_strategy.ipynb solutions/ex10_spot_the_errors.ipynb

# `make test` runs in two streams, one per core (.ci/beside): pytest in this terminal, and beside it nbval, then
# the grader's end-to-end tests (PYTEST_BESIDE). Measured in a fresh-clone `.ci/run` on 6 December 2026 (idle
# 2-core machine, /proc/stat sampled every 10 s): with nbval beside pytest the machine was 95-100 % busy for the
# 13 minutes nbval ran, then 35-65 % (about one core) for the 20 minutes pytest ran alone: a pytest run is mostly
# one process at a time (a fresh interpreter importing torch, a kernel starting, ranks waiting on gloo sockets).
# So the second stream takes the grader's end-to-end tests once nbval is done. Measured in the same way with
# that layout (9c70fb0): the foreground pytest 20 min 15 s, beside it nbval 5 min 48 s + 6 min 8 s then
# tests/test_grading.py 10 min 50 s; the whole .ci/run 24 min 4 s, the cores 88-100 % busy for its first 21 min.
# Two of the grader's tests then moved to tests/test_grading_failures.py, in the foreground, to even the streams.
# The run beside writes to build/beside.log, printed when both are done; the exit status fails if either failed;
# Ctrl-C stops both. NBVAL_BESIDE=0 runs everything one after the other (on a machine that other jobs keep busy,
# where the tests' time limits have less room).
# Before them, scripts/deepspeed_ops.py builds the C++ ops DeepSpeed compiles on first use (its CPU collectives,
# CPUAdam, FusedAdam) while the machine is quiet: about 100 s here, where beside nbval one build ran past ten
# minutes. They go to a folder of this clone's own, so that a lock a stopped build left in ~/.cache cannot hang the
# tests (CI's run on 6 December 2026 failed on one); set TORCH_EXTENSIONS_DIR to use another.
NBVAL_BESIDE ?= 1
BESIDE_LOG := build/beside.log
PYTEST_BESIDE := tests/test_grading.py

test: export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
test: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts
	$(BIN)/python scripts/deepspeed_ops.py
ifeq ($(NBVAL_BESIDE),1)
	bash .ci/beside $(BESIDE_LOG) \
	  'rc=0; $(MAKE) --no-print-directory nbval NBVAL_ISAS="$(NBVAL_ISAS)" || rc=1; \
	   $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_BESIDE) || rc=1; exit $$rc' \
	  '$(BIN)/python -m pytest -q $(addprefix --ignore=,$(PYTEST_BESIDE)) tests'
else
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory nbval NBVAL_ISAS="$(NBVAL_ISAS)"
endif

# The edit loop: ruff and pytest without nbval and without the tests marked slow (tests/conftest.py lists them),
# under 5 minutes here. `make test` stays the full check that CI runs.
test-fast: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts
	$(BIN)/python -m pytest -q -m "not slow" tests

# nbval over every notebook and solution, once per kernel set in NBVAL_ISAS
nbval: $(STAMP)
ifneq ($(NOTEBOOKS),)
	@set -e; $(foreach isa,$(NBVAL_ISAS),echo "== nbval with the $(isa) CPU kernels: $(or $(ISA_$(isa)),as detected)"; \
	  env $(ISA_$(isa)) $(BIN)/python -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg \
	    $(if $(filter native,$(isa)),$(NOTEBOOKS),$(filter-out $(NBVAL_KERNEL_FREE),$(NOTEBOOKS)));)
endif

# the portability check alone: nbval once per kernel set of NBVAL_MATRIX
nbval-matrix:
	$(MAKE) --no-print-directory nbval NBVAL_ISAS="$(NBVAL_MATRIX)"

# what .ci/run calls: the README's `make test`, its nbval run over the whole NBVAL_MATRIX
ci:
	$(MAKE) --no-print-directory test NBVAL_ISAS="$(NBVAL_MATRIX)"

lint: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts

exercises: $(STAMP)
	$(BIN)/zeroedu build-exercises

# the course as a static web book, English and 中文, from the notebooks' saved outputs (no notebook runs); the cheat
# sheets printed to PDF with Chromium where it is installed. Open build/book/index.html.
book: $(STAMP)
	$(BIN)/python -m zeroedu.course.cheatsheet --check
	$(BIN)/python scripts/build_book.py $(if $(wildcard /usr/bin/chromium),--pdf,)
	@echo "open build/book/index.html (English) or build/book/zh/index.html (中文)"

# reveal.js decks, English and 中文: each lesson's title, saved figures and summary (no notebook runs). For a room
# without internet pass a local reveal.js 4 copy: make slides SLIDES_ARGS="--reveal-prefix reveal.js ...".
slides: $(STAMP)
	$(BIN)/python scripts/build_slides.py $(SLIDES_ARGS)
	@echo "open build/slides/en/*.slides.html (English) or build/slides/zh/*.slides.html (中文)"

# which Chinese lessons are out of step with their English cells (docs/zh/style.md says how to update them)
zh-status: $(STAMP)
	$(BIN)/python -m zeroedu.i18n status

# The range, proven on another Python with another torch (docs/instructors.md has the last run): a fresh venv with
# MATRIX_PY and torch==MATRIX_TORCH (on Linux PyPI's wheel is a CUDA build of several GB: pip caches it, and
# MATRIX_WHEELS is searched first), the course installed into it as a learner would (`pip install -e .` keeps that
# torch), then the tour, the fast tests and nbval on notebooks 00-06. Too heavy for every CI run.
MATRIX_PY ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
MATRIX_TORCH ?= 2.14.1
MATRIX_VENV ?= .venv-matrix
MATRIX_WHEELS ?= $(HOME)/.cache/zeroedu-matrix/wheels
MATRIX_NOTEBOOKS := $(wildcard notebooks/0[0-6]_*.ipynb)
MATRIX_TESTS ?= tests
MATRIX_BIN := $(MATRIX_VENV)/bin
MATRIX_STAMP := $(MATRIX_VENV)/.installed-$(MATRIX_TORCH)

define MATRIX_EXTRAS
import re
block = re.search(r"^test = \[(.*?)^\]", open("pyproject.toml").read(), re.M | re.S).group(1)
print("\n".join(r for r in re.findall(r'^\s*"([^"]+)"', block, re.M) if not r.startswith("deepspeed")))
endef
export MATRIX_EXTRAS

# the venv, once per torch version (make clean removes it)
$(MATRIX_STAMP):
	@test -n "$(MATRIX_PY)" || { echo "test-matrix: no python3.12 found; set MATRIX_PY=/path/to/python3.x (another Python than .venv's)"; exit 1; }
	rm -rf $(MATRIX_VENV)
	$(MATRIX_PY) -m venv $(MATRIX_VENV)
	$(MATRIX_BIN)/pip install --quiet --upgrade pip
	$(MATRIX_BIN)/pip install --quiet --find-links $(MATRIX_WHEELS) torch==$(MATRIX_TORCH)
	# the course and its test extra as `make` installs them, but DeepSpeed (pip would build it in an isolated
	# environment with a torch of its own): the list is read from pyproject.toml's `test = [...]`
	$(MATRIX_BIN)/python -c "$$MATRIX_EXTRAS" > $(MATRIX_VENV)/test-extras.txt
	$(MATRIX_BIN)/pip install --quiet -e . -r $(MATRIX_VENV)/test-extras.txt
	# DeepSpeed builds against the torch present (no build isolation); where it cannot, its tests skip
	-$(MATRIX_BIN)/pip install --quiet --no-build-isolation 'deepspeed==0.19.8'
	touch $(MATRIX_STAMP)

# MATRIX_TESTS: the fast tests to run (default all of tests/; a list of files for a shorter run)
test-matrix: $(MATRIX_STAMP)
	@echo "== matrix: $$($(MATRIX_BIN)/python --version) with torch $(MATRIX_TORCH) in $(MATRIX_VENV)"; date -u
	$(MATRIX_BIN)/python -c 'import sys, torch; assert torch.__version__.split("+")[0] == "$(MATRIX_TORCH)", \
	  f"pip replaced torch $(MATRIX_TORCH) by {torch.__version__}"; print("kept torch", torch.__version__, "on", sys.version.split()[0])'
	$(MATRIX_BIN)/python -m zeroedu doctor || true
	$(MATRIX_BIN)/python -m zeroedu tour
	$(MATRIX_BIN)/python -m pytest -q -m "not slow" $(MATRIX_TESTS)
	$(MATRIX_BIN)/python -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg $(MATRIX_NOTEBOOKS)
	@date -u; echo "== matrix passed: $$($(MATRIX_BIN)/python --version), torch $(MATRIX_TORCH)"
	# the hosted path: a notebook's setup cell in a fresh venv that has this other torch (tests/test_setup_cell.py;
	# MATRIX_SETUP_CELL=0 leaves it out, it builds one more venv)
	$(if $(filter 0,$(MATRIX_SETUP_CELL)),@echo "== setup-cell check left out (MATRIX_SETUP_CELL=0)"; exit 0;) ZEROEDU_MATRIX=1 MATRIX_PY=$(MATRIX_PY) MATRIX_TORCH=$(MATRIX_TORCH) MATRIX_WHEELS=$(MATRIX_WHEELS) \
	  $(BIN)/python -m pytest -q tests/test_setup_cell.py -k installs_beside_another_torch

clean:
	rm -rf $(VENV) $(MATRIX_VENV)
