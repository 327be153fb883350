#!/bin/bash
# The GPU run behind docs/performance.md: bench_gpu.py at the issue's sizes, then `make test-gpu`, each
# under its own time limit so that one hanging cannot take the other's output with it. For a GPU machine
# without internet: `benchmarks/device/wheels.sh` (here) fills .whl/ with what its image lacks; carry .whl
# and run `OUT=<dir> bash benchmarks/device/run.sh` there, in the repository root. BENCH_ARGS picks sections.
set -u -o pipefail
T_BENCH=${T_BENCH:-230}; T_TESTS=${T_TESTS:-190}; WORKERS=${WORKERS:-12}
begin=$(date +%s)
log() { echo "[$(( $(date +%s) - begin ))s] $*"; }
PY=$(command -v python3); VENVDIR=$(dirname "$(dirname "$PY")")
log "python3 = $PY"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  || log "wheel install failed"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
  .whl/pycosat-*.tar.gz || log "pycosat build failed"
# benchmarks/device/stub/ray: verl imports ray at module level; nothing of ray runs in what is measured or tested
export PYTHONPATH=$PWD/src:$PWD/research:/tmp/site:$PWD/benchmarks/device/stub
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
log "setup done"
{ nvidia-smi; python3 - <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for m in ["creditrl", "creditrl_research", "trl", "verl", "datasets", "transformers", "accelerate", "peft",
          "reasoning_gym", "math_verify", "gguf", "pyarrow", "hypothesis", "xdist", "pytest_timeout", "ray"]:
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), mod.__file__)
    except Exception as e:
        print(m, "FAILED", type(e).__name__, str(e)[:300])
from verl.trainer.ppo import core_algos; print("verl core_algos imported")
from trl import GRPOTrainer; print("trl GRPOTrainer imported")
PYEOF
} > "$OUT/env.txt" 2>&1
tail -n 25 "$OUT/env.txt"
log "bench_gpu.py (limit ${T_BENCH}s)"
timeout "$T_BENCH" python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
log "bench exit ${PIPESTATUS[0]}"
log "make test-gpu (limit ${T_TESTS}s, $WORKERS workers)"
export CREDITRL_DEVICE_REPORT=$OUT/report
export PYTEST_ADDOPTS="-n $WORKERS --timeout 170 -p no:cacheprovider --junitxml=$OUT/junit.xml -rfE --durations=15"
if command -v make >/dev/null; then
  timeout "$T_TESTS" make -o setup test-gpu VENV="$VENVDIR" > "$OUT/test_gpu.log" 2>&1
else
  log "no make here: running the Makefile's command"
  timeout "$T_TESTS" python3 -m pytest -q -m cuda tests > "$OUT/test_gpu.log" 2>&1
fi
log "test-gpu exit $?"
tail -n 60 "$OUT/test_gpu.log"
