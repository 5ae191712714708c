# make demo: create .venv, install torch (CPU build) first, then grpo, then train the bundled tiny model.
# make test: the same set-up, then the test suite (what CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

$(BIN)/grpo: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull the multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(BIN)/grpo

.PHONY: setup demo test lint
setup: $(BIN)/grpo

demo: setup
	$(BIN)/grpo train

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests scripts
