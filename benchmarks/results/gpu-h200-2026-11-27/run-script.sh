#!/bin/bash
# The device call behind runs 4-5 of docs/performance.md (a copy of benchmarks/device/run.sh's steps; .gpu/ held
# the wheels of benchmarks/device/wheels.sh, antlr4 from a local site-packages and the Ray stand-in).
# One device call: environment, `make test-gpu`'s tests (image python, no venv), then bench_gpu.py.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CREDITRL_DEVICE_REPORT=$OUT/report
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc; } > $OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >> $OUT/env.txt 2>&1
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site:$PWD/.gpu/site:$PWD/.gpu/stub
python3 -c "import sys,torch,transformers,trl,datasets,peft,creditrl; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)" >> $OUT/env.txt 2>&1
python3 -c "import verl; from verl.trainer.ppo import core_algos; print('verl', verl.__version__)" 2>&1 | tail -2 >> $OUT/env.txt
cat $OUT/env.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  T0=$(date +%s)
  timeout ${TEST_S:-240} python3 -m pytest -q -m cuda -n ${NPROC:-8} --timeout 200 -p no:cacheprovider ${TESTS:-tests/test_device.py tests/test_losses.py tests/test_nothing_silent.py tests/test_fused_checks.py tests/test_token_stats.py tests/test_config.py} --junitxml=$OUT/junit.xml > $OUT/test.log 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - T0 )) s" >> $OUT/test.log
  grep -E "^(FAILED|ERROR)|passed|failed|rc=" $OUT/test.log | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  T0=$(date +%s)
  timeout ${BENCH_S:-240} python3 benchmarks/bench_gpu.py --json $OUT/bench_gpu.json ${BENCH_ARGS:-} > $OUT/bench.log 2>&1
  echo "bench rc=$? in $(( $(date +%s) - T0 )) s" >> $OUT/bench.log
  tail -c 6000 $OUT/bench.log
fi
