# creditrl: the two commands of the README.
#   make train  -> set up and run the main job (`creditrl train`, defaults)
#   make test   -> set up and run the whole test suite
# torch==2.13.0 is installed first (a local CPU wheel on the dev/CI machines); the constraint
# file keeps every later install from replacing it with a CUDA build.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
TORCH   ?= 2.13.0
EXTRAS  ?= test

.PHONY: setup train test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "torch==$(TORCH)"
	echo "torch==$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[$(EXTRAS)]"

train: setup
	$(BIN)/creditrl train

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_losses.py
	$(BIN)/python benchmarks/bench_trainer.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
