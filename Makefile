# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates the virtual environment on first use: torch==2.13.0 (the CPU build) first, then this
# package, so no dependency can pull a different torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hot-compile-installed

.PHONY: install test demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/hot-compile demo

clean:
	rm -rf $(VENV) build *.egg-info hot_dump
