# The two commands: `make run` (a demo on the embedded defaults) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install run test bench format clean

# Python caches the bytecode of what it imports, unless PYTHONDONTWRITEBYTECODE is set (this
# project's machines set it): then every process compiles every module it imports again, and
# one importing the control plane (Django, DRF, Celery, scikit-learn, the URLs) takes 7.4 s of
# CPU to start instead of 2.8 s. make test starts many (pytest workers, Celery, gunicorn,
# gateways, engines), so every target here writes the caches.
unexport PYTHONDONTWRITEBYTECODE

# --no-compile: pip would byte-compile every module of every package (~20 s of a fresh
# install); Python compiles the ones imported, once, on first import (above).
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $@

install: $(BIN)/.installed

run: install
	./scripts/run.sh

test: install
	./scripts/test.sh

bench: install
	./scripts/bench.sh

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) var/static var/bench
