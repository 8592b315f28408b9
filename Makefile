# Two commands for a fresh Linux machine (README): `make run` and `make test`. Both idempotent.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "error: $(PY): not found (mtpchat needs Python 3.11)"; exit 2; }
	$(PY) -m venv $(VENV)

# torch first, pinned: pip takes the local CPU build; a plain `torch` would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/mtpchat

test: setup
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
