# Quickstart targets: `make demo` installs into .venv and runs the demo; `make test` runs the tests.
# The install includes the `ray` extra (plain Ray core, about 20 s and 250 MB) so CI runs the Ray launcher's
# tests, and the `parquet` extra (pyarrow) for `export --format parquet` and its tests; `pip install -e .`
# alone does without them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch where a local wheel provides it (this project's CI machines); on a GPU
# machine install the torch build that matches its CUDA first, or override TORCH=...
TORCH  ?= torch==2.13.0

.PHONY: install demo test test-deps clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test,ray,parquet]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/run_shards examples/demo.fasta --out demo_out

# System packages some tests need (a local SLURM cluster, headless Chromium); without root or apt-get it says why and
# does nothing, and those tests skip.
test-deps:
	sh tests/setup/install_slurm.sh
	sh tests/setup/install_chromium.sh

test: install test-deps
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo_out run_shards_out
