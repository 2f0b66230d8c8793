# Two set-up commands: `make run` starts the whole system here, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test lint venv dev-venv bench clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.installed
dev-venv: $(VENV)/.installed-dev

run: $(VENV)/.installed
	./scripts/run.sh

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy potocolom models_registry workers scheduling realtime fleet gpuworker
	$(VENV)/bin/lint-imports --no-cache

test: lint
	$(PY) -m pytest

bench: $(VENV)/.installed-dev
	$(PY) bench/dispatch.py
	$(PY) bench/rebuild.py

clean:
	rm -rf $(VENV) db.sqlite3 db.sqlite3-wal db.sqlite3-shm media models/tiny-sd
