#!/usr/bin/env bash
# The H200 runs behind docs/benchmarks.md, by stage: bash benchmarks/h200_session.sh STAGE [OUT]
# Peers (torchao, flashoptim) are installed from wheels in .whl/ when present (see docs/benchmarks.md).
#   tests      GPU tests and the Triton code of a train step
#   verify     GPU tests and the CUDA-graphed step on 16 x 2048^2 (a short check after a change)
#   optimizer  optimizer-step benchmark (both parameter lists of issue 3)
#   fp8        FP8 linear / transformer-block benchmark against bf16 and torchao
#   train124m  GPT 124M, 1000 steps: fp32 baseline, flashoptim, flashoptim + FP8
#   peers      GPT 124M, 1000 steps: bf16 params and the peers (FlashOptim package, torchao AdamW8bit)
#   variants   optimizer-step compile variants (exact vs approximate division, tuned block sizes) on
#              16 x 2048^2 with per-kernel times, the kernels' registers and SASS instruction counts,
#              and gradient release's peak memory
#   tuning     CUDA graphs and tuned block sizes for the exact step (16 x 2048^2 and 3 GPT-2 layers),
#              the kernels' registers and SASS instruction counts, gradient release's peak memory
#   launch     the step's launch overhead: CUDA graphs, alone and with tuned kernels (16 x 2048^2, 3 GPT-2 layers)
#   cudagraphs optimizer-step benchmark with the step CUDA-graphed (both lists, or LISTS=...)
#   seeds      GPT 124M, 1000 steps, seed 1: fp32 baseline and flashoptim (the loss gap of one run)
#   release    GPT 1.2B memory with gradient release (as `large`'s first half; compare with its JSON)
#   large      GPT 1.2B memory without Inductor (a try costs seconds, not a many-minute compile), and
#              the deepest width-8192 model that fits at batch 1 x 1024 for the baseline and flashoptim
set -uo pipefail
stage=$1
out=${2:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || python -m pip install -q --no-build-isolation --no-deps -e .
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case $stage in
  tests)
    # --continue-on-collection-errors: a test file needing a package missing there (expecttest) is
    # reported, and the other GPU tests still run
    timeout 360 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_h200.log"
    timeout 150 python benchmarks/gpu_check.py /tmp/inspect 2>&1 | tee "$out/gpu_check_h200.log"
    cp /tmp/inspect/optimizer_step_triton.py "$out/adamw_step_triton_h200.py.txt"
    ;;
  verify)
    timeout 300 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_h200.log"
    timeout 200 python benchmarks/optimizer_step.py --lists 16x2048x2048 --configs flashoptim_cudagraphs \
      --out "$out/optimizer_step_verify_h200.json" 2>&1 | tee "$out/optimizer_step_verify_h200.log"
    ;;
  optimizer)
    timeout 560 python benchmarks/optimizer_step.py --out "$out/optimizer_step_h200.json" 2>&1 | tee "$out/optimizer_step_h200.log"
    ;;
  fp8)
    timeout 560 python benchmarks/fp8_linear.py --out "$out/fp8_linear_h200.json" 2>&1 | tee "$out/fp8_linear_h200.log"
    ;;
  train124m)
    timeout 570 python benchmarks/train_gpt.py --config 124m --steps 1000 --eval-every 100 \
      --configs fp32_fused_autocast,flashoptim,flashoptim_fp8 \
      --out "$out/train_gpt_124m_h200.json" --plot "$out" 2>&1 | tee "$out/train_gpt_124m_h200.log"
    ;;
  peers)
    timeout 560 python benchmarks/train_gpt.py --config 124m --steps 1000 --eval-every 100 \
      --configs bf16_adamw,flashoptim_pypi,torchao_adamw8bit \
      --out "$out/train_gpt_124m_more_h200.json" 2>&1 | tee "$out/train_gpt_124m_more_h200.log"
    ;;
  variants)
    timeout 330 python benchmarks/optimizer_step.py --lists 16x2048x2048 \
      --configs torch_fused_fp32,flashoptim,flashoptim_fastdiv,flashoptim_coordesc \
      --out "$out/optimizer_step_variants_h200.json" 2>&1 | tee "$out/optimizer_step_variants_h200.log"
    timeout 60 python benchmarks/kernel_resources.py --match lshift --out "$out/kernel_resources_h200.json"
    timeout 150 python benchmarks/gradient_release.py --out "$out/gradient_release_h200.json" 2>&1 \
      | tee "$out/gradient_release_h200.log"
    ;;
  tuning)
    timeout 150 python benchmarks/optimizer_step.py --lists 16x2048x2048 --configs flashoptim_cudagraphs,flashoptim_tuned \
      --out "$out/optimizer_step_tuning_h200.json" 2>&1 | tee "$out/optimizer_step_tuning_h200.log"
    timeout 240 python benchmarks/optimizer_step.py --lists gpt2_3layers --configs torch_fused_fp32,flashoptim,flashoptim_tuned \
      --out "$out/optimizer_step_tuning_gpt2_h200.json" 2>&1 | tee "$out/optimizer_step_tuning_gpt2_h200.log"
    timeout 120 python benchmarks/kernel_resources.py --match lshift --out "$out/kernel_resources_h200.json"
    timeout 150 python benchmarks/gradient_release.py --out "$out/gradient_release_h200.json" 2>&1 \
      | tee "$out/gradient_release_h200.log"
    ;;
  launch)
    timeout 300 python benchmarks/optimizer_step.py --lists 16x2048x2048 --configs flashoptim_cudagraphs,flashoptim_tuned \
      --out "$out/optimizer_step_launch_h200.json" 2>&1 | tee "$out/optimizer_step_launch_h200.log"
    timeout 250 python benchmarks/optimizer_step.py --lists gpt2_3layers --configs flashoptim_cudagraphs \
      --out "$out/optimizer_step_launch_gpt2_h200.json" 2>&1 | tee "$out/optimizer_step_launch_gpt2_h200.log"
    ;;
  cudagraphs)
    # LISTS: the parameter lists to run (default both of issue 3's), e.g. LISTS=gpt2_124m
    timeout 560 python benchmarks/optimizer_step.py --lists "${LISTS:-64x2048x2048,gpt2_124m}" \
      --configs torch_fused_fp32,flashoptim_cudagraphs,flashoptim_pypi \
      --out "$out/optimizer_step_cudagraphs_h200.json" 2>&1 | tee "$out/optimizer_step_cudagraphs_h200.log"
    ;;
  seeds)
    timeout 570 python benchmarks/train_gpt.py --config 124m --steps 1000 --eval-every 100 --seed 1 \
      --configs fp32_fused_autocast,flashoptim \
      --out "$out/train_gpt_124m_seed1_h200.json" 2>&1 | tee "$out/train_gpt_124m_seed1_h200.log"
    ;;
  release)
    timeout 300 python benchmarks/train_gpt.py --config 1b --steps 10 --warmup 4 --eval-every 10 --eval-batches 1 \
      --configs flashoptim_release --no-inductor \
      --out "$out/train_gpt_1b_release_eager_h200.json" 2>&1 | tee "$out/train_gpt_1b_release_eager_h200.log"
    ;;
  large)
    timeout 200 python benchmarks/train_gpt.py --config 1b --steps 10 --warmup 4 --eval-every 10 --eval-batches 1 \
      --configs fp32_fused_autocast,flashoptim --no-inductor \
      --out "$out/train_gpt_1b_eager_h200.json" 2>&1 | tee "$out/train_gpt_1b_eager_h200.log"
    timeout 380 python benchmarks/train_gpt.py --config 1b --dim 8192 --heads 64 --layers 4 --batch 1 --find-largest \
      --out "$out/train_gpt_find_largest_h200.json" 2>&1 | tee "$out/train_gpt_find_largest_h200.log"
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
