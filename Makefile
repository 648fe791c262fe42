# The two commands of the README's quickstart, plus the developer chores behind them.
# Everything installs into ./.venv on first use (torch's CPU wheel first, so no CUDA build is pulled).

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTHON ?= python3

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)                 ## train a small GPT through switch and optimizer node on loopback
	$(VENV)/bin/luwu demo $(ARGS)

test: $(STAMP)                 ## the test suite (what CI runs)
	$(VENV)/bin/pytest $(ARGS)

lint: $(STAMP)                 ## ruff and mypy (the type-check ratchet in pyproject.toml); CI runs it
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py

bench: $(STAMP)                ## the benchmarks, each against its baseline in the same run
	@# bytecode for luwu's modules, as an installed luwu has: with PYTHONDONTWRITEBYTECODE=1 (or a
	@# read-only tree) every process (ranks, switch, engines) would compile them at each start
	$(PY) -m compileall -q dataplane worker luwu p4 controller proto mininet
	$(VENV)/bin/luwu bench allreduce --workers 4 --verify
	$(VENV)/bin/luwu bench optimizer

p4: $(STAMP)                   ## regenerate p4/ generated sources and P4Info, then check them
	$(VENV)/bin/luwu p4 generate

# The GPU machine's image (docs/gpu.md) has torch, numpy, grpcio, transformers ... but not these:
# wheels for its Python (CPython 3.12, x86-64), carried with the tree to `bash scripts/gpu-check`.
# grpcio and protobuf are floors (installed there only over older copies); luwu's own wheel is the
# fallback should building it from the tree fail there.
WHEELS      ?= .whl
GPU_WHEELS  := finsy==0.30.0 parsy==2.2 pyee==13.0.1 scapy==2.8.0 pyroute2==0.9.7 grpcio==1.85.3 protobuf==6.33.6
GPU_TARGET  := --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
               --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels: $(STAMP)           ## wheels of luwu's dependencies the GPU image lacks, into .whl/ (docs/gpu.md)
	rm -rf $(WHEELS)
	$(PY) -m pip download -q --no-deps $(GPU_TARGET) -d $(WHEELS) $(GPU_WHEELS)
	PYTHONWARNINGS=ignore $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEELS)/luwu .
	du -sh $(WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: install demo test lint bench p4 gpu-wheels clean
