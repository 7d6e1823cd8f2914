# The two commands in README.md: `make tour` and `make test`. Each builds .venv first if needed.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: tour test lint nbval exercises clean

$(STAMP): pyproject.toml scripts/install_torch.py
	@command -v $(PY) >/dev/null || { echo "zeroedu needs Python 3.11 ($(PY) not found); set PY=/path/to/python3.11"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, and the CPU build unless an NVIDIA GPU is there to use (Linux: PyPI's wheel is the
	# CUDA build); installed before the rest so that no other package can ask for a build of its own.
	$(BIN)/python scripts/install_torch.py
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

tour: $(STAMP)
	$(BIN)/zeroedu tour

NOTEBOOKS := $(wildcard notebooks/*.ipynb solutions/*.ipynb)

test: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts
	$(BIN)/python -m pytest -q tests
ifneq ($(NOTEBOOKS),)
	$(BIN)/python -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg $(NOTEBOOKS)
endif

lint: $(STAMP)
	$(BIN)/ruff check zeroedu tests examples scripts

exercises: $(STAMP)
	$(BIN)/zeroedu build-exercises

clean:
	rm -rf $(VENV)
