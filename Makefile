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

# The paper's §3 scenario on the calibrated H100 1P1D model: a +100 % ten-minute surge traps the engine.
demo: venv
	mkdir -p out
	$(BIN)/basin simulate --deployment h100-1p1d --policy hicache --workload terminal-bench \
		--base-rate 3.3 --surge-factor 2.0 --surge-start-min 15 --surge-minutes 10 --duration-min 120 \
		--seed 8 --json out/demo.json --plot out/demo.png
	@echo "figure: out/demo.png, full result: out/demo.json"

lint: venv
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
