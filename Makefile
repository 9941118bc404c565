# Quickstart targets: `make demo` installs into .venv and runs the demo; `make test` runs the tests.
# The install includes the `ray` extra (plain Ray core, about 20 s and 250 MB) so CI runs the Ray launcher's
# tests, and the `parquet` extra (pyarrow) for `export --format parquet` and its tests; `pip install -e .`
# alone does without them (it installs sentencepiece, with which transformers reads ProtT5's half-precision
# encoder tokenizer, published as spiece.model alone).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# Which torch build: the CUDA one (PyPI's default on Linux) on a machine with an NVIDIA GPU (nvidia-smi
# answers, or the driver's /proc/driver/nvidia exists), else the CPU-only one (about a tenth of the size),
# from the indexes pip is configured with (a local wheel, as on this project's CI machines) or else from
# PyTorch's CPU index. Override with DEVICE=cpu|cuda, or TORCH=... (pip arguments), e.g.
# TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" for another CUDA version; after
# an install, `make clean` first.
TORCH_VERSION ?= 2.13.0
DEVICE ?= $(shell (nvidia-smi -L >/dev/null 2>&1 || test -d /proc/driver/nvidia) && echo cuda || echo cpu)
ifeq ($(DEVICE),cuda)
TORCH ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?=
else
TORCH ?= torch==$(TORCH_VERSION)+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif

# What the message of a failed CPU torch install suggests where PyTorch's CPU index cannot be reached (a firewall,
# a mirror of PyPI alone): PyPI's build, with the PYTHON and VENV given to this make.
TORCH_RETRY = $(strip TORCH=torch==$(TORCH_VERSION) $(foreach v,PYTHON VENV,$(if $(filter command line,$(origin $(v))),$(v)=$($(v)))))
TORCH_HINT = Where $(TORCH_INDEX) cannot be reached, PyPI's CUDA build of torch (about 3 GB with its CUDA libraries; it runs on CPU too) does: make $(or $(MAKECMDGOALS),install) $(TORCH_RETRY)

.PHONY: install demo test test-deps clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH) (this machine: $(DEVICE); override with TORCH=...)"
	$(BIN)/python -m pip install -q $(TORCH) 2>/dev/null || \
		$(BIN)/python -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) || \
		{ echo "error: pip could not install $(TORCH) into $(VENV) ($$($(BIN)/python -V)) from its indexes$(if $(TORCH_INDEX), or $(TORCH_INDEX)) (pip's message is above).$(if $(TORCH_INDEX), $(TORCH_HINT))" >&2; exit 1; }
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

# Two pytest-xdist workers: most tests wait on worker processes, schedulers and timeouts, so one pytest process
# keeps a 2-core machine about 60% busy (three are no faster there: docs/BENCHMARKS.md). TEST_WORKERS=0 runs the
# suite in one process. compileall first: the suite starts the CLI and its workers about 900 times, and where
# Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1, set on this project's VMs) each process of a clean clone
# compiled the modules it imports anew, about 0.25 CPU s; compileall writes their .pyc regardless, once.
TEST_WORKERS ?= 2
test: install test-deps
	$(BIN)/python -m compileall -q -j 0 pipeline index triton_kernels tests tools bench
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

clean:
	rm -rf $(VENV) demo_out run_shards_out
