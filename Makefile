# The two set-up commands of the README: `make demo` (main job, embedded default) and `make test`.
# Both create .venv on first use and install Basin into it with its dev extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint venv clean

$(BIN)/basin: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/basin

demo: venv
	$(BIN)/basin workload stats --workload terminal-bench --seed 1

lint: venv
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
