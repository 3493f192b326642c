# Quick start: `make demo` trains the built-in tiny model, `make test` runs the suite.
# Both create .venv on first use. TORCH picks the PyTorch build: the default is the
# 2.13.0 release (CPU wheel here; on Linux with a GPU, PyPI's torch==2.13.0 is the CUDA build).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.scaletrain-installed

.PHONY: demo lint test test-fast test-properties test-gpu test-mutations test-mutations-auto slurm-install slurm-test \
	docs docs-serve install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/scaletrain train --config configs/tiny.toml

# ruff, pinned in the dev extra and configured in pyproject.toml; .ci/run runs it before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs/hooks

# TEST_JOBS pytest processes (pytest-xdist), each given whole files (--dist loadfile: a module's
# shared process group still runs once). Most tests run on one core, or wait on a subprocess or a
# rank; two processes keep both cores of a 2-core machine busy. TEST_JOBS=0 runs in this process.
# The files go out in the order tests/conftest.py sorts them, the slowest first.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# the inner loop: everything in one process (no ranks, signals or mounts), under 3 minutes
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not multiproc and not slow"

# the property tests alone (tests/*/test_*_properties.py) under Hypothesis's "long" profile: 1,000 fresh
# random examples a property instead of the suite's 30 fixed ones (docs/testing.md, "Properties")
test-properties: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-long} $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile \
		$(wildcard tests/*/test_*_properties.py)

# the tests that need a CUDA device (marked gpu; on a CPU machine they skip, each with its reason)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# Slurm for tests/launch/test_slurm.py (the docs' sbatch scripts and torchrun lines on a cluster of two nodes that
# the tests start on this machine, in network namespaces): Debian's packages, installed with apt-get when missing
# and this is root. Never fails: without Slurm (or root) those tests skip, each with its reason. `make test` runs
# them where Slurm is installed; slurm-test runs them alone (about 5 minutes on 2 cores).
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm-install:
	@if ! test -x /usr/sbin/slurmctld && ! command -v slurmctld >/dev/null; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
	        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) >/dev/null; then \
	        echo "slurm-install: installed $(SLURM_PACKAGES)"; \
	    else echo "slurm-install: Slurm is not installed and apt-get could not install it (root and a package mirror" \
	        "are needed): the Slurm tests skip"; fi; \
	fi

slurm-test: $(STAMP) slurm-install
	$(PY) -m pytest -q -m slurm tests/launch/test_slurm.py

# plants known bugs one at a time on a copy of the tree and shows which tests catch each, by how
# much (docs/testing.md); a few minutes, not part of `make test`
test-mutations: $(STAMP)
	$(PY) tests/mutations.py

# mutmut's mutants (every operator, comparison, constant and argument changed in turn) over the modules of
# MoE, chat data, document masks, local SGD, adapters, fault tolerance and the HF families, each with its own
# fast tests (tests/mutations_auto.py; SUBJECTS="moe chat" for some); tens of minutes, not part of `make test`
test-mutations-auto: $(STAMP)
	$(PY) tests/mutations_auto.py $(SUBJECTS)

# the documentation site (mkdocs.yml, docs/): the docs extra installed once, then a strict build into site/
# (a broken link, a page left out of the navigation or a block without its marker fails); docs-serve serves
# it at http://127.0.0.1:8000 and rebuilds on each change. The reference pages are written from the code.
DOCS_STAMP := $(VENV)/.scaletrain-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) runs site .pytest_cache
