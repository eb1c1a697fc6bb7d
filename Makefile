# make run   : execute every notebook headless and summarise the measurements (build/ only: the checkout stays clean)
#              (the README's first command: tests/test_readme_commands.py runs it on one notebook)
# make readme: refresh the README's notebook index from build/results.json (after make run, on purpose)
# make test  : unit tests and every notebook, headless (what CI runs)
# make test-browser : the widget panels in JupyterLab, driven by headless Chromium (installs both)
# make lab   : JupyterLab on notebooks/
# make test-gpu : everything on a CUDA GPU (emulating a T4 on other GPUs); exits 2 with one line without CUDA
# make gpu-wheels: the wheels a lent GPU machine without a network lacks, in carries of at most 60 MiB
# A fresh machine needs only Python 3.11+ and make: the first target creates .venv and installs.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# uv installs requirements.txt's pins from its cache in seconds, where pip took about 2.5 minutes on every fresh
# clone (it downloads each wheel again). uv does not read pip's configuration: the find-links pip has (the
# PIP_FIND_LINKS variable and `pip config`, where the CI machine keeps its CPU build of torch) are passed to it.
# Should uv fail, pip installs the same pins.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
# This machine's pip config names local indexes that may not exist; pip warns once per package.
PIP_NOISE := is ignored: it is neither a file nor a directory
# DeepSpeed compiles its CPU ops with ninja on first use (cpu_adam and its shared-memory comm op: about 3 minutes on
# 2 cores), into TORCH_EXTENSIONS_DIR. Keep them between runs and between clones, in the user's cache (PyTorch's own
# default place), in a folder per environment: ninja builds again when the command (which names this .venv's paths)
# or a source's date changes, and every install writes DeepSpeed's sources anew. The install gives them one fixed
# date (DS_SOURCE_DATE), so a fresh clone at the same place with the same requirements.txt reuses the build; a
# changed requirements.txt (another DeepSpeed or torch) gets a folder of its own.
DS_BUILD_KEY := $(shell { echo "$(abspath $(VENV))"; cat requirements.txt 2>/dev/null; } | cksum | cut -d' ' -f1)
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions/colab-memopt-$(DS_BUILD_KEY)
DS_SOURCE_DATE := 2000-01-01 00:00:00 UTC
export MPLBACKEND ?= Agg
# Bytecode: where PYTHONDONTWRITEBYTECODE=1 is set (as on this project's CI machine), Python reads .pyc files but never
# writes them, and every process (each notebook's kernel, each test worker, each command a test runs) compiled torch,
# transformers and this package from source again: 'import colab_memopt' took 7.5 s instead of 3.1 s. This Makefile's
# commands write them, as Python does by default: into .venv and this checkout's __pycache__ folders (git ignores them).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED := 1

.PHONY: install run readme test test-unit test-notebooks test-browser browser-deps lab clean test-gpu gpu-wheels

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION) 2>&1 | { grep -v "$(PIP_NOISE)" || true; } || true
	links="$${PIP_FIND_LINKS:-} $$($(PY) -m pip config get global.find-links 2>/dev/null || true)"; \
	$(UV) pip install --python $(PY) --quiet $$(for l in $$links; do printf -- '--find-links %s ' "$$l"; done) -r requirements.txt -e . \
	|| { echo "uv could not install the environment: installing it with pip instead (slower)"; \
	     $(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt 2>&1 | { grep -v "$(PIP_NOISE)" || true; } && \
	     $(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e . 2>&1 | { grep -v "$(PIP_NOISE)" || true; }; }
	find $(VENV)/lib/python3*/site-packages/deepspeed/ops -type f -exec touch -d "$(DS_SOURCE_DATE)" {} +
	$(PY) -c "import colab_memopt, torch, papermill, nbval; print('installed: torch', torch.__version__)"
	@touch $(STAMP)

# make run [NOTEBOOKS="04 13"] [RUN_OUT=build] [RUN_ARGS="--cell-timeout 60"]: only those notebooks (stems, number
# prefixes or paths), into RUN_OUT; RUN_ARGS go to the runner (python -m colab_memopt.tooling.runner --help).
RUN_OUT ?= build
run: $(STAMP)
	$(PY) -m colab_memopt.tooling.runner --out $(RUN_OUT) $(RUN_ARGS) $(NOTEBOOKS)

# Rewrites README.md's notebook index (committed) from the last full `make run`; run it on purpose.
readme: $(STAMP)
	$(PY) -m colab_memopt.tooling.rollup --results build/results.json --claims build/claims.md --readme README.md

# One pytest session on two workers (pytest-xdist; CI has 2 cores): unit tests, static notebook checks, and every
# notebook executed once by nbval on the copies papermill prepared with the CI parameters (each timed against its
# budget); then each notebook's results. One session keeps both workers busy to the end: the notebooks go first,
# the long ones with the short unit tests beside them. --dist loadscope keeps a notebook's cells in one kernel
# (a scope is a file or a class) and --no-loadscope-reorder keeps this order.
# One thread per worker: two workers whose torch each runs an OpenMP thread per core oversubscribe the two cores,
# and the notebooks ran 3.5x slower (06, 13, 14 and 16 on two workers: 191 s with torch's default threads, 54 s with one).
XDIST := -n 2 --dist loadscope --no-loadscope-reorder
WORKER_THREADS := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# DeepSpeed's CPU Adam, which notebook 10 builds on first use, is built without debug information (tests/cxx_g0: the
# same -O3 code, 67 s of CPU instead of 113 s on 2 cores), in a cache folder of its own (a build with other flags is
# another build: make run keeps its own).
TEST_BUILD := CM_CXX="$${CXX:-c++}" CXX=$(CURDIR)/tests/cxx_g0 TORCH_EXTENSIONS_DIR=$(TORCH_EXTENSIONS_DIR)-g0
# The tests that hold plans against real CPU Trainer runs come first, each the first work of its worker process:
# an earlier test in the same process leaves state that makes a real Trainer step hold more (not yet identified).
MEASURED_TESTS := tests/test_trainer_models.py tests/test_trainer_hostile.py
# The longest test files (130 s and 90 s of the session's 1,130 s of tests on 2026-11-29) start right after the
# notebooks: last in collection order, they ran alone on one worker at the session's end while the other sat idle.
EARLY_TESTS := tests/test_stack.py tests/test_planner.py
# The notebook-marked tests read what the nbval run recorded; they live in these two files.
NOTEBOOK_RESULT_TESTS := tests/test_notebooks.py tests/test_widgets_and_project.py
test: $(STAMP)
	rm -rf build/ci_notebooks build/results build/notebook_seconds.json build/notebook_stderr.json
	$(PY) -m colab_memopt.tooling.runner --prepare-only build/ci_notebooks
	$(WORKER_THREADS) $(TEST_BUILD) PYTHONPATH=tests$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) -m pytest -q -p nbval_budget -p no:cacheprovider \
		--nbval-lax --nbval-current-env $(XDIST) -m "not notebook and not browser" $(addprefix --run-first=,$(MEASURED_TESTS)) \
		$(addprefix --run-early=,$(EARLY_TESTS)) build/ci_notebooks tests
	$(PY) -m pytest $(NOTEBOOK_RESULT_TESTS) -m notebook -q -p no:cacheprovider
	$(BROWSER_TEST_IF_AVAILABLE)

test-unit: $(STAMP)
	$(PY) -m pytest tests -m "not notebook and not browser" -q $(addprefix --ignore=,$(MEASURED_TESTS))
	$(PY) -m pytest $(MEASURED_TESTS) -q

# make test-notebooks NOTEBOOKS="10 13": only those (stems, number prefixes or paths); all by default.
test-notebooks: $(STAMP)
	rm -rf build/ci_notebooks build/results build/notebook_seconds.json build/notebook_stderr.json
	$(PY) -m colab_memopt.tooling.runner --prepare-only build/ci_notebooks $(NOTEBOOKS)
	PYTHONPATH=tests$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) -m pytest -q -p nbval_budget -p no:cacheprovider --nbval-lax --nbval-current-env build/ci_notebooks
	CM_NOTEBOOKS="$(NOTEBOOKS)" $(PY) -m pytest tests -m notebook -q

# make test-gpu [WHEELHOUSE=dir] [CM_EMULATE=t4|none] [GPU_PYTHON=python3]: unit tests, tests/gpu, every
# notebook with its Colab defaults under its budget (tests/notebook_parameters_t4.yaml; README.md untouched),
# the planner-accuracy grid and the technique costs on CUDA; writes build/gpu/ (colab_memopt/tooling/gpucheck.py).
# It uses the Python that has CUDA torch (this repo's .venv if present, else python3) and installs what
# that one lacks, from PyPI or from WHEELHOUSE. Without CUDA it stops before running anything, in one line.
# On a lent GPU machine (no network, one call of 10 minutes): `python -m colab_memopt.gpucheck plan` prints the
# one command (GPU_ARGS="--parallel 5 ...": slices side by side, one deadline, one archive) and what to carry.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
ifneq ($(filter test-gpu,$(MAKECMDGOALS)),)
GPU_FOUND := $(shell $(GPU_PYTHON) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
ifneq ($(GPU_FOUND),1)
$(error make test-gpu needs a CUDA GPU: $(GPU_PYTHON) has no torch that sees one (torch.cuda.is_available() is not True); nothing was run)
endif
endif

test-gpu:
	$(GPU_PYTHON) -m colab_memopt.gpucheck --out build/gpu $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE)) $(GPU_ARGS)

# make gpu-wheels [WHEELHOUSE_DIR=build/wheelhouse]: download (here, with a network) exactly the wheels a lent GPU machine
# lacks for its Python 3.12 (manylinux x86_64; DeepSpeed as an sdist with setuptools and wheel), split into parts of at
# most 60 MiB (colab_memopt/tooling/wheelhouse.py); part1 holds every wheel, DeepSpeed's sdist a part of its own. The one call
# on a lent machine carries part1 with the checkout (under 64 MiB): `python -m colab_memopt.gpucheck plan`.
WHEELHOUSE_DIR ?= build/wheelhouse
gpu-wheels: $(STAMP)
	$(PY) -m colab_memopt.tooling.wheelhouse --dest $(WHEELHOUSE_DIR)

# The widget panels in a real browser. Debian's chromium (apt, needs root, as in CI) and the Python
# playwright package from requirements-browser.txt; Playwright's browser download is not used.
BROWSER_STAMP := $(VENV)/.browser-installed
CHROMIUM ?= /usr/bin/chromium
export CHROMIUM
BROWSER_TEST := $(PY) -m pytest tests/browser -m browser -q -s -p no:cacheprovider
# make test drives one panel end to end and the deliberately broken callbacks (a few minutes); make
# test-browser drives every panel (about 20 minutes on 2 cores), which would put make test far past 15.
BROWSER_TEST_FAST := $(BROWSER_TEST) -k "00_where_the_memory_goes or broken_callback"
# make test runs the browser test only where Chromium and playwright are installed, and says so otherwise.
define BROWSER_TEST_IF_AVAILABLE
@if [ -x "$(CHROMIUM)" ] && $(PY) -c "import playwright" 2>/dev/null; then \
	echo "browser test: $(CHROMIUM) and playwright found: notebook 00's panel and the broken callbacks (make test-browser drives every panel)"; $(BROWSER_TEST_FAST); \
else \
	echo "browser test SKIPPED: no $(CHROMIUM) or no playwright in $(VENV) (run 'make test-browser' to install both and run it)"; \
fi
endef

browser-deps: $(BROWSER_STAMP)

$(BROWSER_STAMP): $(STAMP) requirements-browser.txt
	@test -x "$(CHROMIUM)" || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-browser.txt 2>&1 | { grep -v "$(PIP_NOISE)" || true; }
	"$(CHROMIUM)" --version
	@touch $(BROWSER_STAMP)

test-browser: $(BROWSER_STAMP)
	$(BROWSER_TEST)

# MPLBACKEND=Agg (exported above for headless runs) would hide the notebooks' plots in the lab.
lab: $(STAMP)
	env -u MPLBACKEND $(PY) -m jupyter lab notebooks/

clean:
	rm -rf build .pytest_cache
