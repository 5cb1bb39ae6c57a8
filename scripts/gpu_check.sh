#!/usr/bin/env bash
# The GPU check (issues 6 and 8), one device call of a few minutes: the `gpu`-marked tests (CUDA graphs replay
# to the eager engine's tokens, torch.profiler's CUDA tables and idle gaps, NVML sampling, drafter training on
# the GPU), then benchmarks on random-init targets (no weights travel): experiments/bench_decode_graphs.py
# (plain decode steps, then speculative verify steps; its tables go into docs/profiling.md), a profile of an
# eager verify step, experiments/bench_verify.py (what a verify step of n tokens costs, for the tree-drafting
# analysis) and experiments/bench_train.py (drafter training speed); those go into docs/speculative.md.
#   here, once:  scripts/gpu_wheels.sh                     (hydra, omegaconf, wandb wheels into .whl/)
#   the tree that travels must stay under 64 MiB, which the drafter checkpoints (~127 MB, unused here) are over:
#     git rm -r -q --cached checkpoints/smollm2 && echo /checkpoints/smollm2/ >> .git/info/exclude
#   device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)
#   afterwards:  git reset -q -- checkpoints, and drop that line from .git/info/exclude
# Logs and the table's JSON go to $OUT (the device tool's return folder), else outputs/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-outputs/gpu_check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=offline
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
# NOTE: the device tool returns at most 8 files: the tests' log, one log for every benchmark, the verify profile
# and the tables' JSON.
log="$out/benchmarks.log"
timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --continue-on-collection-errors tests/test_cuda_graphs.py \
  tests/test_profiling.py tests/test_logging_and_plots.py tests/test_drafters.py 2>&1 | tee "$out/gpu_tests.log" || status=1
# where an eager verify step's time goes: at batch 1 it was cuDNN's per-shape attention plans (101 -> 22.5 ms once
# eager steps kept cuDNN off, session 33); at batch 16 it is 136 ms, the chunk attention on the math backend
for batch in 1 16; do
  timeout 90 python3 experiments/bench_decode_graphs.py --shapes smollm2 --batches $batch --spec-tokens 7 --steps 8 \
    --profile 4 2>&1 | tee -a "$out/verify_profile.log" || status=1
done
timeout 150 python3 experiments/bench_decode_graphs.py --batches 1,16,64 --out "$out/decode_graphs.json" 2>&1 \
  | tee -a "$log" || status=1
for k in 2 7; do   # speculative verify steps (1 + k tokens a request) and the drafter's forward, graphed or not
  timeout 90 python3 experiments/bench_decode_graphs.py --shapes smollm2 --batches 1,16 --spec-tokens $k \
    --out "$out/verify_graphs_k$k.json" 2>&1 | tee -a "$log" || status=1
done
# engine=dflash_tree's step: a verify of 1 + 62 tree tokens and the tree built on the host (session 35's tau 2.79 /
# 2.20 on GSM8K / MT-Bench is measured on CPU; what its step costs on a GPU decides its speedup there)
timeout 60 python3 experiments/bench_decode_graphs.py --shapes smollm2 --batches 1 --spec-tokens 7 --tree-nodes 62 \
  --out "$out/verify_graphs_tree62.json" 2>&1 | tee -a "$log" || status=1
for precision in highest high; do   # train.matmul_precision: gpu_train.sh's recipe trains in TF32 (high)
  timeout 50 python3 experiments/bench_train.py --device cuda --kinds dflash --batches 16,64 --features online \
    --matmul-precision $precision 2>&1 | tee -a "$log" || status=1
done
timeout 100 python3 experiments/bench_train.py --device cuda --kinds dflash,eagle --batches 4,16,64 \
  --out "$out/train.json" 2>&1 | tee -a "$log" || status=1
for model in smollm2 llama-1b; do
  timeout 45 python3 experiments/bench_verify.py --model $model --device cuda --dtype bfloat16 \
    --rows 1,2,3,4,6,8,16,32,64 --calls 30 2>&1 | tee -a "$log" || status=1
done
exit $status
