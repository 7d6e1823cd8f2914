# The two commands in README.md: `make tour` and `make test`. Each builds .venv first if needed.
# Python: the first of these that is in zeroedu's range (pyproject.toml requires-python, 3.10 to 3.14); 3.11 first,
# the tested default. `make PY=/path/to/python3.12 tour` picks one yourself.
PY_CANDIDATES := python3.11 python3.12 python3.13 python3.10 python3.14 python3
PY_IN_RANGE := import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] < (3, 15)))
PY ?= $(firstword $(foreach p,$(PY_CANDIDATES),$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c '$(PY_IN_RANGE)' 2>/dev/null && echo $(p))))
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: tour test test-fast ci lint nbval nbval-matrix test-matrix exercises book zh-status clean

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
NBVAL_KERNEL_FREE := solutions/ex09_choose_strategy.ipynb

test: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory nbval NBVAL_ISAS="$(NBVAL_ISAS)"

# The edit loop: ruff and pytest without nbval and without the tests marked slow (a few minutes). `make test`
# stays the full check that CI runs.
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

.PHONY: tour test ci lint nbval nbval-matrix test-matrix exercises book zh-status clean

clean:
	rm -rf $(VENV) $(MATRIX_VENV)
