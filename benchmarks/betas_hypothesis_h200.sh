#!/usr/bin/env bash
# H200, 2026-12-02: which change moved the Triton step off stock AdamW in
# tests/test_gpu.py::test_triton_step_matches_stock_adamw_and_eager_rewrite (455 of 131072 masters
# past the tolerance, benchmarks/results/gpu_tests_flat_h200.log): float betas held as fp32
# tensors by the bucket optimizers, or approximate division. Run with the code of commit 9f77646
# (betas as tensors from the first step); its output is benchmarks/results/betas_hypothesis_h200.log.
#   bash benchmarks/betas_hypothesis_h200.sh
export PYTHONPATH=/tmp/site
python - <<'PY' 2>&1 | grep -E "==|passed|failed|worst" | cut -c1-300
import pytest, torch
import flash_inductor.flat as f
print("== tensor betas off")
f._TENSOR_HYPERPARAMETERS.clear()
pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py", "-k", "triton_step and False"])
f._TENSOR_HYPERPARAMETERS.add("betas")
print("== exact division")
torch._inductor.config.eager_numerics.division_rounding = True
torch._dynamo.reset()
pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py", "-k", "triton_step and False"])
PY
