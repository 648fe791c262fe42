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

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: install demo test lint bench p4 clean
