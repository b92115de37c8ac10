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
#   flat       issue 13: the flat optimizer step on 64 x 2048^2, GPT-2 124M's list and our 1.2B GPT's, with the
#              peers (torch fused AdamW fp32/bf16, FlashOptim), plain and CUDA-graphed
#   flatparts  what the flat step's parts cost (exact division, no error terms, fp32 states, tuned blocks)
#   flattests  GPU tests, and the first step's compile time for 4 and 64 tensors of 2048^2
#   kernel     issue 13: GPU tests, then the flat step with the hand-written Triton kernel (the default) and
#              Inductor's, on 64 x 2048^2, GPT-2 124M's list and our 1.2B GPT's, with the peers
#   blocks     issue 13: the hand-written step's GPU tests, and its launch shapes (groups per program, warps)
#   final13    issue 13/14 in one call: the hand-written step's GPU tests, the three lists with the peers,
#              and HF GPT-2 124M (baseline, flashoptim, flashoptim + FP8) with plots
#   step3      issue 13/14: the hand-written step's GPU tests (three launches), its launch shapes again, and a
#              profile of HF GPT-2's train step (baseline, flashoptim, flashoptim + FP8: wall vs GPU time, kernels)
#   landing    issue 14/15: HF GPT-2's train step profiled again (gradients accumulate into preset views; baseline and
#              flashoptim), then
#              the quality protocol's (e) rows, three seeds
#   fp8lm1b    issue 16: the FP8-gradient GPU tests, then our 1.2B GPT: default flashoptim and FP8-LM's optimizer
#              states, each with bf16 and FP8 gradients (peak memory, step time)
#   quality    issue 15: GPT 124M, 1500 steps with the schedule, 3 seeds (seed-major) of the fp32 baseline,
#              flashoptim and flashoptim + FP8, 3 runs at once, stopped at 505 s; QUALITY_ARGS replaces the
#              selection (e.g. "--pairs flashoptim_fp8:2 flashoptim_no_masters:0 ..."), NAME the output name,
#              QUALITY_JOBS the runs at once (3), QUALITY_DEADLINE the seconds after which none starts (505)
#   large      GPT 1.2B memory without Inductor (a try costs seconds, not a many-minute compile), and
#              the deepest width-8192 model that fits at batch 1 x 1024 for the baseline and flashoptim
#   hfgpt2     issue 14: Hugging Face GPT-2 124M, 300 steps, every row of hf_clients.py, with plots
#   hfllama    issue 14: Hugging Face Llama ~1B (context 4096), 300 steps: baseline, flashoptim, flashoptim + FP8,
#              each profiled for 3 steps; then the FP8-LM preset's GPU test (issue 16)
#   fp8fix     issue 14: the FP8 GPU tests (the weight gradient's transposes in their own kernel), then the Llama's
#              FP8 row again (lm_head excluded, transposes apart; merge with hfllama's JSON: --report-from), and
#              HF GPT-2's baseline, flashoptim and FP8 rows, 300 steps
#   hfllamapeers  the Llama's other rows: gradient release, FlashOptim 0.1.4, torchao float8
#   launch13   issue 13/16: every GPU test of tests/test_gpu.py, the hand-written step's launch shapes
#              (adam_kernel_sweep.py: bit-identical to the default, timed), then optimizer_step.py with the
#              peers, the default and the sweep's fastest shape on 64 x 2048^2 (a shape per list)
#   arith13    issue 13: the hand-written kernel's cheaper arithmetic (LaunchShape ``approx``) against the exact one:
#              the GPU tests of the kernel (both arithmetics), adam_kernel_sweep.py over 8 shapes (exact ones bit-identical
#              to the default, approx ones held to the fp64 reference), then optimizer_step.py with the peers, the
#              default and the sweep's fastest shape on 64 x 2048^2 (a shape per list)
#   fp8lm1b2   issue 16/14: fp8lm1b's four rows in one run (no tests), then the Llama's torchao float8 row
#   hfllamafp8 issue 14: the Llama's FP8 loss gap: our FP8 pass on the fp32-master baseline (baseline_fp8),
#              to set against torchao_float8 (+1.86%) and flashoptim_fp8_fp32states (+5.03%); before it, the
#              rows FlashOptim 0.1.4 and gradient release (one compiled step per parameter layout)
#   fp8drift   issue 14: the FP8 GPU tests, and fp8_gradient_check.py's gradients against fp32 after 50, 150 and 300
#              baseline steps of the Llama (bf16, FP8 tensorwise with and without fast accumulation, row-wise)
#   fp8seeds   issue 14: the FP8 GPU tests (the e4m3 output gradient's among them) in the background, beside
#              hfllamaseeds' runs of RUNS (log named by the card; SUFFIX names a rerun's)
#   hfllamacausal issue 14: the speed of the Llama's baseline and FP8 rows (60 steps, profiled) with SDPA's
#              is_causal (flash attention) in place of the explicit causal mask that transformers passes
#              under torch.compile before torch 2.14
#   hfllamaseeds  issue 14: the Llama's loss over seeds (300 steps, transformers' mask as in the seed-0 rows):
#              RUNS="config:seed ..." each its own process on the one GPU (their times are not their own, their losses
#              and memory are), the first alone until its first step is done (STAGED=0: all at once), then the others
#              (from the FX graph cache where they share its configuration), merged with hf_clients.py --report-from
#              into NAME (one JSON, one log);
#              SEED_ARGS: more arguments for every run (e.g. "--steps 120 --lr-warmup 30"); PARALLEL=N: at most N
#              runs at once (an H100 holds three baselines), the finished ones merged as each run ends
#   hfllamagraphs issue 14: the Llama's speed with SDPA's is_causal: the baseline against the FP8 rows with
#              cudagraphs=True (GRAPH_CONFIGS), 60 steps (GRAPH_STEPS), profiled, then 20 steps back to back
#              (--pipelined); first the GPU tests of CUDA graphs and FP8 (GRAPH_TESTS=0 skips them); NAME names the output
#   hfsnapshot issue 14: who holds the memory between steps, HF GPT-2 124M: baseline and flashoptim
#   llamapeak  issue 14: what the Llama's @train_step (flashoptim, is_causal, 2 x 4096) holds at its steady peak
#   gptsnapshot   the same for our GPT (train_gpt.py's, 124m shape): flashoptim
#   landing14  issue 14, PART=speed (default): every GPU test (gradients landed at the step, the FP8 transposes
#              merged), then the Llama's baseline against flashoptim + FP8 + fast accumulation + cudagraphs
#              (is_causal, 40 steps, 20 back to back, profiled); PART=release: the Llama with Hugging Face's
#              activation checkpointing, baseline and regional flashoptim with and without gradient release
#   releasebatch issue 14: the Llama at one sequence of 1024 tokens, where the peak is not at the loss: the baseline,
#              flashoptim (one compiled backward returns every gradient at once), regional flashoptim (gradients
#              landed as each layer's backward ends) and the same with gradient release; steady peaks (no clipping)
#   buckets    issue 14: prepare's bucket_numel against one bucket: the Llama's peak at one sequence (the step held
#              the gradients twice) and its FP8 step's speed
#   fp8lmstates issue 14, FP8-LM's optimizer states: the GPU tests of what changed, optimizer_step.py on the 1.2B
#              GPT's tensors (the default step against the FP8-LM one, its per-tensor amax without atomics), then
#              the Llama (is_causal, 40 steps, profiled, 20 back to back): the baseline against FP8 linears with
#              FP8-LM's states (fast accumulation, cudagraphs), the one configuration left for the three
#              targets together (its loss over seeds: hfllamaseeds with RUNS="flashoptim_fp8+fastaccum+fp8lmstates:0 ...")
#   fp8lmcheck issue 14: FP8 linears with FP8-LM's states ended 5.9% below the baseline; the FP8-LM GPU tests, and
#              120 steps of seed 1 for the baseline and the rows that separate the suspects (hfllamaseeds' RUNS, SEED_ARGS)
#   fp8lmdebug issue 14: the compiled FP8-LM step's "misaligned address": fp8lm_gpu_check.py and the failing test,
#              launches synchronous, with their Inductor code
#   fp8lmfixed issue 14: the same after the fix (segment_pieces), with the Llama's six seeds of FP8 + FP8-LM states
#   fp8lmkernel issue 14: FP8-LM's states stepped by the hand-written kernels (triton_adam._step_tensor_scaled), by
#              PART: tests (default; the GPU tests of tests/test_fp8lm_states.py and the hand-written step's of
#              tests/test_gpu.py, or those TESTS selects, log named with SUFFIX; then optimizer_step.py on the 1.2B
#              GPT's tensors: the default, FP8-LM's states by the kernels and by Inductor), buckets (the buckets
#              stage's first half: the Llama at one sequence with and without bucket_numel), speed (the Llama,
#              is_causal, 40 steps, profiled, 20 back to back: the baseline against FP8 linears with FP8-LM's
#              states, with one bucket and with bucket_numel)
#   amaxslots  issue 14: the FP8-LM amax kernel's atomics spread over slots (fp8lmkernel's tests part, SUFFIX _slots),
#              then the Llama at 2 x 4096 regional + checkpointed + chunked loss, with and without gradient release
#   chunkedloss issue 14: the option loss_chunk_rows (the lm_head and its cross-entropy 1024 rows at a time): the
#              Llama (is_causal, 40 steps, 20 back to back) with FP8 linears and FP8-LM's states, and flashoptim,
#              each with and without it (peak memory, speed); CONFIGS picks rows, SUFFIX names the files
#   bf16scales issue 14: the companded states' bf16 group scales run by their kernels: the GPU tests and the step
#              alone on the 1.2B GPT's tensors; their loss: hfllamaseeds with RUNS="flashoptim:0 ..."
#   fp8grads   issue 14: where our FP8 pass and torchao's part on the Llama (ours ended above torchao's on both seeds
#              run): one step's gradients, bf16 against ours (eager and Inductor) and torchao, after 50 baseline steps
#   statefidelity issue 14: the companded states' loss gap: state_fidelity.py on the Llama's baseline run (300 steps,
#              transformers' mask, seed 0), each candidate format's Adam update against exact fp32 moments fed the same
#              gradients (CANDIDATES picks formats of state_candidates.py); their effect on training: hfllamaseeds with
#              RUNS="flashoptim+emulate_NAME:0 ..."
#   nearestscales issue 14: the companded states' bf16 scales rounded to nearest where that keeps the top code: every
#              GPU test of the companded and FP8-LM steps, beside fp8grads (one step's FP8 gradients on the Llama); with
#              PART=step the step alone on the 1.2B GPT's tensors; their loss: hfllamaseeds with RUNS="flashoptim:0 ..."
#   fp8kernels issue 14: where the FP8 step's GPU time goes, kernel by kernel, on the Llama cut to 2 layers (the full
#              model's layer shapes; CONFIGS picks rows), with Inductor's code of every graph (gzipped), which
#              names each kernel of the profile
#   zoo        issue 14: the FP8 GPU tests (among them linears in a checkpointed region; TESTS a -k selection),
#              then Hugging Face architectures we did not write (hf_zoo.py, size small; MODELS picks them, STEPS,
#              LR, ROWS, LIMIT the seconds, PROFILE=N profiles N steps of each row; NAME the output, by default
#              named by the card); PART=tests or PART=zoo runs one
#              of the two
#   fp8sizes   issue 14: where an FP8 linear pays: forward + backward of one linear, bf16 against FP8 (current
#              scaling, fast accumulation), plain and CUDA-graphed, at the sizes of hidden 1024-2048 models (SHAPES)
#   inplace    issue 14: the hand-written step reads each gradient where the backward left it (no flat gradient
#              buffer under @train_step), by PART: tests (every GPU test of the companded and FP8-LM steps and of
#              gradient release, tests/test_gpu.py's FP8 and CUDA graphs' ones among them), batch1 (optimizer_step.py
#              on the 1.2B GPT's tensors: the kernel's time with its gradient addresses; then the Llama at one
#              sequence, where @train_step peaked at the step: read in place against copied, +copygrads), speed (the Llama, is_causal, 40 steps, 20 back to back, profiled:
#              the baseline against FP8 + fast accumulation + cudagraphs, read in place and copied: speed and the
#              reserved footprint of CUDA graphs), recompute (the Llama, is_causal, 40 steps: flashoptim and FP8 +
#              fast accumulation + cudagraphs, each with and without recompute_elementwise: peak memory, speed)
#   rowwise    issue 14: FP8 with row-wise scales (fp8="rowwise", torchao's "rowwise" recipe), by PART: tests (its GPU
#              tests against the fp64 reference, the casting transposes of tests/test_fp8_transpose.py, CUDA graphs'
#              steps with kept gradients and two backward passes a step,
#              nn.TransformerEncoderLayer's attention projections as FP8 GEMMs; TESTS a -k selection),
#              linears (forward + backward of the Llama's linears: bf16, ours tensorwise and row-wise, torchao's two
#              recipes), speed (the Llama, is_causal, 40 steps: the baseline against FP8 + fast accumulation + cudagraphs,
#              tensorwise and row-wise; CONFIGS picks rows, LIMIT the seconds, PROFILE=N profiles N steps of each,
#              PROFILE_TOP=K lists its K slowest kernels),
#              profile (row-wise alone, 20 steps back to back, 3 profiled), layers2 (the Llama cut to 2 layers,
#              tensorwise and row-wise in one process, or the rows of CONFIGS, e.g. with +multikernel for
#              persistent reductions; every kernel of 3 profiled steps; LIMIT the seconds). SUFFIX names
#              the logs of a rerun; files named by the card (h100 / h200). Its loss over seeds: hfllamaseeds with
#              RUNS="flashoptim_fp8+fastaccum+rowwise:0 ..." (the baselines of the same seeds are stored)
#   rowwisecompile issue 14: the first step's compile, row-wise against tensorwise, on the Llama cut to 2 layers (full
#              shapes, is_causal, 10 steps), each row in its own process with an empty Inductor cache; the report's
#              compile seconds per graph; files named by the card (h100 / h200)
#   division   issue 14: FP8 scales computed without an fp32 division, and the model graphs' own divisions left to
#              Inductor's default (approximate in Triton, as a stock torch.compile); by PART, one or several in order:
#              tests (the GPU tests of FP8 scales, linears, row-wise and token counts), layers2 (the Llama cut to 2
#              layers: tensorwise and row-wise, each also with +exactdiv, every kernel of 3 profiled steps), speed
#              (the Llama: the baseline against tensorwise and row-wise, 40 steps, 20 back to back); files named by
#              the card (h100 / h200)
#   multigpu   issue 17, on a machine of 2 or 8 GPUs (logs named by the GPU count), one part per call
#              (each fits 10 minutes), MGPU_PART=: tests (the NCCL variants of the distributed tests, default),
#              124m / 1b (DDP and FSDP2, bf16 vs fp8_collectives, 200 steps), 124m_single / 1b_single (the
#              single-GPU run of the global batch, the loss reference; MGPU_GPUS=2 runs it on one GPU for a 2-GPU
#              machine's batch). NVLink multicast stays off in every process.
set -uo pipefail
stage=$1
out=${2:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# installed once per machine: stages started side by side must not reinstall under each other's running processes
if ! python -m pip show -q flash-inductor >/dev/null 2>&1; then
  python -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 || python -m pip install -q --no-build-isolation --no-deps -e .
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site ] || python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# the card in result names where a stage says so (h100 or h200: the device lends either)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00' | tr 'H' 'h')
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# logged NAME LIMIT SCRIPT ARGS...: benchmarks/SCRIPT ARGS under `timeout LIMIT`, writing
# $out/NAME.json, with its output printed and kept in $out/NAME.log
logged() {
  local name=$1 limit=$2 script=$3
  shift 3
  timeout "$limit" python "benchmarks/$script" "$@" --out "$out/$name.json" 2>&1 | tee "$out/$name.log"
}
# merge_seed_runs DIR NAME: hfllamaseeds' runs in DIR, each log's end into $out/NAME.log and the finished runs'
# JSON merged into $out/NAME.json
merge_seed_runs() {
  for log in "$1"/*.log; do echo "== $log"; grep -v "^W1\|^  warnings" "$log" | tail -n 25; done > "$out/$2.log"
  if ls "$1"/*.json >/dev/null 2>&1; then
    python benchmarks/hf_clients.py --report-from "$1"/*.json --out "$out/$2.json" >> "$out/$2.log" 2>&1
  fi
}
# companded_gpu_tests NAME [LIMIT]: every GPU test of the companded and FP8-LM steps and of gradient release, into
# $out/NAME.log, under `timeout LIMIT` (330 s)
companded_gpu_tests() {
  timeout "${2:-330}" python -m pytest -v -m gpu tests/test_gpu.py tests/test_fp8lm_states.py tests/test_gradient_release.py \
    2>&1 | grep -v "^DEBUG" > "$out/$1.log"
}

case $stage in
  final13)
    timeout 130 python -m pytest -v -m gpu tests/test_gpu.py 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_final_h200.log"
    tail -4 "$out/gpu_tests_final_h200.log"
    logged optimizer_step_final_h200 150 optimizer_step.py --lists 64x2048x2048,gpt2_124m,gpt_1b \
      --configs torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_inductor,flashoptim_pypi,flashoptim_block128_warps4
    logged hf_clients_gpt2_h200 270 hf_clients.py --model gpt2 --configs baseline,flashoptim,flashoptim_fp8 --plot "$out"
    ;;
  landing)
    logged hf_profile_gpt2_landing_h200 160 hf_clients.py --model gpt2 --configs baseline,flashoptim \
      --steps 25 --warmup 10 --log-every 25 --profile 5
    logged quality_ablation_h200 305 quality.py --pairs flashoptim_no_masters:0 flashoptim_no_masters:1 flashoptim_no_masters:2 \
      --jobs 3 --deadline-s 270 --runs-dir /tmp/quality --plot "$out/quality_ablation_h200.png"
    ;;
  fp8lm1b)
    timeout 50 python -m pytest -v -m gpu tests/test_gpu.py -k "fp8_gradients" 2>&1 | grep -v "^DEBUG" \
      > "$out/gpu_tests_fp8_gradients_h200.log"
    tail -4 "$out/gpu_tests_fp8_gradients_h200.log"
    # ${FP8LM_CONFIGS}: a subset, when a call has little time (the JSON is written after each row)
    logged train_gpt_1b_fp8lm_h200 "${FP8LM_LIMIT:-300}" train_gpt.py --config 1b --steps 12 --warmup 4 --eval-every 12 \
      --eval-batches 1 --configs "${FP8LM_CONFIGS:-flashoptim,flashoptim_fp8grads,flashoptim_fp8lm,flashoptim_fp8lm_fp8grads}"
    ;;
  step3)
    timeout 150 python -m pytest -v -m gpu tests/test_gpu.py 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_step3_h200.log"
    tail -4 "$out/gpu_tests_step3_h200.log"
    logged optimizer_step_step3_h200 170 optimizer_step.py --lists 64x2048x2048,gpt2_124m \
      --configs torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_block16_warps2,flashoptim_block32_warps2,flashoptim_block128_warps8
    logged hf_profile_gpt2_h200 260 hf_clients.py --model gpt2 --configs baseline,flashoptim,flashoptim_fp8 \
      --steps 25 --warmup 10 --log-every 25 --profile 5
    ;;
  blocks)
    timeout 240 python -m pytest -v -m gpu tests/test_gpu.py 2>&1 | grep -v "^DEBUG" | tee "$out/gpu_tests_blocks_h200.log"
    logged optimizer_step_blocks_h200 200 optimizer_step.py --lists 64x2048x2048,gpt2_124m \
      --configs torch_fused_fp32,flashoptim,flashoptim_block8_warps1,flashoptim_block16_warps4,flashoptim_block32_warps4,flashoptim_block64_warps4,flashoptim_block32_warps8
    ;;
  kernel)
    timeout 330 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_kernel_h200.log"
    logged optimizer_step_kernel_h200 250 optimizer_step.py --lists 64x2048x2048,gpt2_124m,gpt_1b \
      --configs torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_inductor,flashoptim_pypi
    ;;
  tests)
    # --continue-on-collection-errors: a test file needing a package missing there (expecttest) is
    # reported, and the other GPU tests still run
    timeout 360 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_h200.log"
    timeout 150 python benchmarks/gpu_check.py /tmp/inspect 2>&1 | tee "$out/gpu_check_h200.log"
    cp /tmp/inspect/optimizer_step_triton.py "$out/adamw_step_triton_h200.py.txt"
    ;;
  verify)
    timeout 300 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_h200.log"
    logged optimizer_step_verify_h200 200 optimizer_step.py --lists 16x2048x2048 --configs flashoptim_cudagraphs
    ;;
  optimizer)
    logged optimizer_step_h200 560 optimizer_step.py
    ;;
  fp8)
    logged fp8_linear_h200 560 fp8_linear.py
    ;;
  train124m)
    logged train_gpt_124m_h200 570 train_gpt.py --config 124m --steps 1000 --eval-every 100 \
      --configs fp32_fused_autocast,flashoptim,flashoptim_fp8 --plot "$out"
    ;;
  peers)
    logged train_gpt_124m_more_h200 560 train_gpt.py --config 124m --steps 1000 --eval-every 100 \
      --configs bf16_adamw,flashoptim_pypi,torchao_adamw8bit
    ;;
  variants)
    logged optimizer_step_variants_h200 330 optimizer_step.py --lists 16x2048x2048 \
      --configs torch_fused_fp32,flashoptim,flashoptim_exactdiv,flashoptim_coordesc
    timeout 60 python benchmarks/kernel_resources.py --match lshift --out "$out/kernel_resources_h200.json"
    logged gradient_release_h200 150 gradient_release.py
    ;;
  tuning)
    logged optimizer_step_tuning_h200 150 optimizer_step.py --lists 16x2048x2048 \
      --configs flashoptim_cudagraphs,flashoptim_tuned
    logged optimizer_step_tuning_gpt2_h200 240 optimizer_step.py --lists gpt2_3layers \
      --configs torch_fused_fp32,flashoptim,flashoptim_tuned
    timeout 120 python benchmarks/kernel_resources.py --match lshift --out "$out/kernel_resources_h200.json"
    logged gradient_release_h200 150 gradient_release.py
    ;;
  launch)
    logged optimizer_step_launch_h200 300 optimizer_step.py --lists 16x2048x2048 \
      --configs flashoptim_cudagraphs,flashoptim_tuned
    logged optimizer_step_launch_gpt2_h200 250 optimizer_step.py --lists gpt2_3layers --configs flashoptim_cudagraphs
    ;;
  cudagraphs)
    # LISTS: the parameter lists to run (default both of issue 3's), e.g. LISTS=gpt2_124m
    logged optimizer_step_cudagraphs_h200 560 optimizer_step.py --lists "${LISTS:-64x2048x2048,gpt2_124m}" \
      --configs torch_fused_fp32,flashoptim_cudagraphs,flashoptim_pypi
    ;;
  seeds)
    logged train_gpt_124m_seed1_h200 570 train_gpt.py --config 124m --steps 1000 --eval-every 100 --seed 1 \
      --configs fp32_fused_autocast,flashoptim
    ;;
  release)
    logged train_gpt_1b_release_eager_h200 300 train_gpt.py --config 1b --steps 10 --warmup 4 --eval-every 10 \
      --eval-batches 1 --configs flashoptim_release --no-inductor
    ;;
  large)
    logged train_gpt_1b_eager_h200 200 train_gpt.py --config 1b --steps 10 --warmup 4 --eval-every 10 \
      --eval-batches 1 --configs fp32_fused_autocast,flashoptim --no-inductor
    logged train_gpt_find_largest_h200 380 train_gpt.py --config 1b --dim 8192 --heads 64 --layers 4 --batch 1 \
      --find-largest
    ;;
  flat)
    logged optimizer_step_flat_h200 560 optimizer_step.py --lists 64x2048x2048,gpt2_124m,gpt_1b \
      --configs torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_cudagraphs,flashoptim_pypi
    ;;
  flatparts)
    logged optimizer_step_flat_parts_h200 400 optimizer_step.py --lists 64x2048x2048 \
      --configs flashoptim,flashoptim_exactdiv,flashoptim_bf16masters,flashoptim_fp32states,flashoptim_coordesc
    ;;
  flattests)
    timeout 330 python -m pytest -v -m gpu --continue-on-collection-errors tests 2>&1 | tee "$out/gpu_tests_flat_h200.log"
    timeout 120 python benchmarks/release_memory_diag.py "$out/release_memory_diag_flat_h200.json" 2>&1 \
      | tee "$out/release_memory_diag_flat_h200.log"
    timeout 240 python benchmarks/compile_time.py --device cuda --shape 2048 --counts 4,64 \
      --out "$out/compile_time_h200.json" 2>&1 | tee "$out/compile_time_h200.log"
    ;;
  hfgpt2)
    logged hf_clients_gpt2_h200 570 hf_clients.py --model gpt2 --plot "$out"
    ;;
  hfllama)
    logged hf_clients_llama_h200 470 hf_clients.py --model llama --configs baseline,flashoptim,flashoptim_fp8 \
      --profile 3 --plot "$out"
    timeout 90 python -m pytest -v -m gpu tests/test_fp8lm_states.py 2>&1 | grep -v "^DEBUG" | tail -5 \
      | tee "$out/gpu_tests_fp8lm_h200.log"
    ;;
  fp8fix)
    timeout 150 python -m pytest -v -m gpu tests/test_gpu.py -k "transpose or fp8" 2>&1 | grep -v "^DEBUG" \
      > "$out/gpu_tests_fp8_transpose_h200.log"
    tail -4 "$out/gpu_tests_fp8_transpose_h200.log"
    logged hf_clients_llama_fp8_h200 270 hf_clients.py --model llama --configs flashoptim_fp8 --profile 3
    logged hf_clients_gpt2_h200 250 hf_clients.py --model gpt2 --configs baseline,flashoptim,flashoptim_fp8 --plot "$out"
    ;;
  launch13)
    timeout 200 python -m pytest -v -m gpu tests/test_gpu.py 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_launch13_h200.log"
    tail -4 "$out/gpu_tests_launch13_h200.log"
    logged adam_kernel_sweep_h200 200 adam_kernel_sweep.py --lists 64x2048x2048,gpt2_124m
    fastest=$(python benchmarks/adam_kernel_sweep.py --fastest "$out/adam_kernel_sweep_h200.json" --list 64x2048x2048)
    logged optimizer_step_launch13_h200 170 optimizer_step.py --lists 64x2048x2048,gpt2_124m \
      --configs "torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_pypi,$fastest"
    ;;
  arith13)
    # every GPU test of the step: the kernel's (both arithmetics) and gradient release's (one step per layout)
    timeout 200 python -m pytest -v -m gpu tests/test_gpu.py tests/test_gradient_release.py 2>&1 | grep -v "^DEBUG" \
      > "$out/gpu_tests_arith13_h200.log"
    tail -4 "$out/gpu_tests_arith13_h200.log"
    # the default and 32 x 2 (the fastest exact layouts), with and without approx, first; then approx on the next
    # fastest exact layouts of launch13's sweep (16 x 2 x vector 8, 16 x 2, 32 x 4 x vector 8, 64 x 8 x vector 8)
    shapes=block64_warps4,block64_warps4_approx,block32_warps2,block32_warps2_approx,block16_warps2_vector8_approx
    shapes=$shapes,block16_warps2_approx,block32_warps4_vector8_approx,block64_warps8_vector8_approx
    logged adam_kernel_sweep_arith13_h200 170 adam_kernel_sweep.py --lists 64x2048x2048,gpt2_124m --time-limit 140 \
      --shapes "$shapes"
    fastest=$(python benchmarks/adam_kernel_sweep.py --fastest "$out/adam_kernel_sweep_arith13_h200.json" --list 64x2048x2048)
    logged optimizer_step_arith13_h200 150 optimizer_step.py --lists 64x2048x2048,gpt2_124m \
      --configs "torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_pypi,$fastest"
    ;;
  fp8lm1b2)
    logged train_gpt_1b_fp8lm_h200 "${FP8LM_LIMIT:-300}" train_gpt.py --config 1b --steps 12 --warmup 4 --eval-every 12 \
      --eval-batches 1 --configs flashoptim,flashoptim_fp8grads,flashoptim_fp8lm,flashoptim_fp8lm_fp8grads
    logged hf_clients_llama_torchao_h200 250 hf_clients.py --model llama --configs torchao_float8
    ;;
  hfllamafp8)
    logged hf_clients_llama_more2_h200 560 hf_clients.py --model llama --configs flashoptim_pypi,flashoptim_release,baseline_fp8
    ;;
  hfllamacausal)
    logged hf_clients_llama_causal_h200 400 hf_clients.py --model llama --attention is_causal \
      --configs baseline,flashoptim_fp8 --steps 60 --log-every 20 --profile 3
    ;;
  hfllamaseeds)
    name=${NAME:-hf_clients_llama_seeds_h200} runs_dir=/tmp/hfseeds
    mkdir -p "$runs_dir"
    first=1
    # shellcheck disable=SC2086  # RUNS is a list
    for run in ${RUNS:-baseline:1 baseline:2 flashoptim:1 flashoptim:2 flashoptim+fp32act:0 flashoptim+fp32act:1}; do
      config=${run%:*} seed=${run#*:} log="$runs_dir/${config}_s$seed.log"
      # PARALLEL=N: at most N runs at once; the runs done so far are merged into $out as each ends, so that a
      # call cut off at its limit still returns them
      while [ "${PARALLEL:-0}" -gt 0 ] && [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do
        wait -n
        merge_seed_runs "$runs_dir" "$name"
      done
      # 16 cores for the first run's compile, 4 for each of the others'; a block freed by one run is not
      # kept from the others
      TORCHINDUCTOR_COMPILE_THREADS=$([ $first = 1 ] && echo 16 || echo 4) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        timeout "${LIMIT:-540}" python benchmarks/hf_clients.py --model llama --configs "$config" --seed "$seed" --shared-gpu \
        --log-every 50 ${SEED_ARGS:-} --out "$runs_dir/${config}_s$seed.json" > "$log" 2>&1 &
      if [ $first = 1 ] && [ "${STAGED:-1}" = 1 ]; then
        # The others start once the first has compiled (its first step is done): runs of its configuration then
        # load its graphs from Inductor's caches while it trains, where all at once they compiled together for
        # about 205 s with the GPU idle (hf_clients_llama_seeds_rowwise_h200.log)
        while kill -0 $! 2>/dev/null && ! grep -q "^  step     1 " "$log"; do sleep 2; done
      fi
      first=0
    done
    wait
    merge_seed_runs "$runs_dir" "$name"
    cat "$out/$name.log"
    ;;
  hfllamagraphs)
    if [ "${GRAPH_TESTS:-1}" = 1 ]; then
      timeout 150 python -m pytest -v -m gpu tests/test_gpu.py -k "cudagraphs or fp8_transpose or compiled_fp8" 2>&1 \
        | grep -v "^DEBUG" > "$out/gpu_tests_cudagraphs_h200.log"
      tail -4 "$out/gpu_tests_cudagraphs_h200.log"
    fi
    logged "${NAME:-hf_clients_llama_graphs_h200}" 420 hf_clients.py --model llama --attention is_causal \
      --configs "${GRAPH_CONFIGS:-baseline,flashoptim_fp8+cudagraphs,flashoptim_fp8+fp32act+cudagraphs}" --steps "${GRAPH_STEPS:-60}" \
      --log-every 20 --pipelined 20 --profile "${GRAPH_PROFILE:-3}"
    ;;
  hfllamapeers)
    logged hf_clients_llama_more_h200 570 hf_clients.py --model llama \
      --configs flashoptim_release,flashoptim_pypi,torchao_float8
    ;;
  hfsnapshot)
    # at most 8 files come back from a device call: 2 rows x (txt, json, pickle) + json + log
    logged hf_snapshot_gpt2_h200 500 hf_clients.py --model gpt2 --configs baseline,flashoptim --snapshot "$out"
    ;;
  llamapeak)
    # what @train_step's steady peak holds on the Llama at 2 x 4096 (flashoptim; the chunked loss did not lower it)
    logged hf_snapshot_llama_h200 230 hf_clients.py --model llama --attention is_causal --configs flashoptim \
      --snapshot "$out" --snapshot-entries 300000
    ;;
  gptsnapshot)
    logged hf_snapshot_gpt_h200 300 hf_clients.py --model gpt --configs flashoptim --snapshot "$out"
    ;;
  quality)
    name=${NAME:-quality_h200}
    # shellcheck disable=SC2086  # QUALITY_ARGS is a list of arguments
    deadline=${QUALITY_DEADLINE:-505}
    logged "$name" $((deadline + 35)) quality.py ${QUALITY_ARGS:---seeds 0 1 2 --configs fp32_fused_autocast,flashoptim,flashoptim_fp8} \
      --jobs "${QUALITY_JOBS:-3}" --deadline-s "$deadline" --runs-dir /tmp/quality --plot "$out/$name.png"
    ;;
  landing14)
    case ${PART:-speed} in
      speed)
        timeout 260 python -m pytest -v -m gpu tests/test_gpu.py tests/test_gradient_release.py tests/test_fp8_delayed.py \
          2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_landing14_h200.log"
        tail -4 "$out/gpu_tests_landing14_h200.log"
        logged hf_clients_llama_landing_h200 330 hf_clients.py --model llama --attention is_causal \
          --configs baseline,flashoptim_fp8+fastaccum+cudagraphs --steps 40 --log-every 20 --pipelined 20 --profile 2
        ;;
      release)
        logged hf_clients_llama_checkpoint_h200 560 hf_clients.py --model llama --attention is_causal \
          --configs baseline+checkpoint,flashoptim+regional+checkpoint,flashoptim_release+regional+checkpoint \
          --steps 8 --warmup 3 --log-every 4
        ;;
    esac
    ;;
  releasebatch)
    # SHARED=1: other runs share the GPU (their times are not this run's; its memory is)
    logged hf_clients_llama_release_batch1_h200 420 hf_clients.py --model llama --attention is_causal --batch 1 \
      --seq 1024 --clip 0 --configs baseline,flashoptim,flashoptim+regional,flashoptim_release+regional --steps 8 \
      --warmup 3 --log-every 4 ${SHARED:+--shared-gpu}
    ;;
  buckets)
    # prepare's bucket_numel (2**26 elements, +buckets): the Llama at one sequence of 1024 tokens, where the peak
    # is at the step (@train_step held the gradients twice there), and its speed at 2 x 4096 with FP8, each
    # against the same row with one bucket
    logged hf_clients_llama_buckets_batch1_h200 300 hf_clients.py --model llama --attention is_causal --batch 1 \
      --seq 1024 --clip 0 --configs flashoptim,flashoptim+buckets --steps 8 --warmup 3 --log-every 4
    logged hf_clients_llama_buckets_h200 330 hf_clients.py --model llama --attention is_causal \
      --configs flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+fastaccum+cudagraphs+buckets --steps 40 \
      --log-every 20 --pipelined 20
    ;;
  fp8lmstates)
    # the GPU tests of what changed (the FP8-LM states' segmented amax, FP8 gradients, the FP8 transposes),
    # the step alone on the 1.2B GPT's tensors (the default against the FP8-LM states), then the Llama
    timeout 150 python -m pytest -v -m gpu tests/test_gpu.py tests/test_fp8lm_states.py \
      -k "segment_max or fp8lm or transpose or fp8_gradients" 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_fp8lmstates_h200.log"
    tail -4 "$out/gpu_tests_fp8lmstates_h200.log"
    logged optimizer_step_fp8lm_h200 150 optimizer_step.py --lists gpt_1b --configs flashoptim,flashoptim_fp8lmstates
    logged hf_clients_llama_fp8lmstates_h200 330 hf_clients.py --model llama --attention is_causal \
      --configs baseline,flashoptim_fp8+fastaccum+cudagraphs+fp8lmstates --steps 40 \
      --log-every 20 --pipelined 20 --profile 2
    ;;
  fp8lmcheck)
    # why FP8 linears with FP8-LM's states ended 5.9% below the baseline (fifteenth session): the FP8-LM GPU tests
    # (the step against the fp64 reference on 40 tensors) beside 120 steps of one seed (the 300-step runs' warm-up)
    # for the baseline and the rows that separate the suspects: the pair without Inductor (+eager), without the merged
    # FP8 transposes (+nocse), and each of the two alone
    timeout 300 python -m pytest -v -m gpu tests/test_fp8lm_states.py 2>&1 | grep -v "^DEBUG" \
      > "$out/gpu_tests_fp8lmcheck_h200.log" &
    RUNS=${RUNS:-"baseline:1 flashoptim_fp8+fastaccum+fp8lmstates:1 flashoptim_fp8+fastaccum+fp8lmstates+eager:1
      flashoptim_fp8+fastaccum+fp8lmstates+nocse:1 flashoptim+fp8lmstates:1 flashoptim_fp8+fastaccum:1"} \
      SEED_ARGS=${SEED_ARGS:-"--steps 120 --lr-warmup 30"} NAME=${NAME:-hf_clients_llama_fp8lmcheck_h200} \
      LIMIT=${LIMIT:-500} bash "$0" hfllamaseeds "$out"
    wait
    tail -4 "$out/gpu_tests_fp8lmcheck_h200.log"
    ;;
  fp8lmdebug)
    # the compiled FP8-LM step's "misaligned address" on 40 tensors, found by fp8lmcheck: each piece of
    # tensor_scaled.py compiled alone (fp8lm_gpu_check.py), and the failing test with every launch synchronous,
    # with the Inductor code of both
    timeout 450 python benchmarks/fp8lm_gpu_check.py --out "$out/fp8lm_gpu_check_h200.json" > "$out/fp8lm_gpu_check_h200.log" 2>&1 &
    CUDA_LAUNCH_BLOCKING=1 TORCHINDUCTOR_CACHE_DIR=/tmp/fp8lm_forty timeout 300 python -m pytest -v -m gpu \
      tests/test_fp8lm_states.py -k forty 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_fp8lm_forty_h200.log"
    grep -rl --include=*.py "def call(" /tmp/fp8lm_forty | xargs cat > "$out/gpu_tests_fp8lm_forty_code.txt"
    wait
    tail -3 "$out/gpu_tests_fp8lm_forty_h200.log"; cat "$out/fp8lm_gpu_check_h200.log"
    ;;
  fp8lmfixed)
    # after segment_pieces (Inductor no longer plans segment_max's index buffers): the FP8-LM and FP8-gradient GPU
    # tests, fp8lm_gpu_check.py on both layouts, and the Llama's loss over six seeds with FP8 linears and FP8-LM's states
    timeout 300 python -m pytest -v -m gpu tests/test_fp8lm_states.py tests/test_gpu.py -k "fp8lm or forty or segment_max or fp8_gradients" \
      2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_fp8lmfixed_h200.log" &
    timeout 450 python benchmarks/fp8lm_gpu_check.py --out "$out/fp8lm_gpu_check_fixed_h200.json" \
      > "$out/fp8lm_gpu_check_fixed_h200.log" 2>&1 &
    RUNS=${RUNS:-"$(echo flashoptim_fp8+fastaccum+fp8lmstates:{0,1,2,3,4,5})"} NAME=${NAME:-hf_clients_llama_seeds_fp8lm_fixed_h200} \
      LIMIT=${LIMIT:-520} bash "$0" hfllamaseeds "$out"
    wait
    tail -3 "$out/gpu_tests_fp8lmfixed_h200.log"; cat "$out/fp8lm_gpu_check_fixed_h200.log"
    ;;
  fp8lmkernel)
    case ${PART:-tests} in
      tests)
        timeout 240 python -m pytest -v -m gpu tests/test_fp8lm_states.py tests/test_gpu.py \
          -k "${TESTS:-fp8lm or segment_max or forty or hand_written or triton or fp8_gradients}" 2>&1 | grep -v "^DEBUG" \
          > "$out/gpu_tests_fp8lmkernel${SUFFIX:-}_h200.log"
        tail -12 "$out/gpu_tests_fp8lmkernel${SUFFIX:-}_h200.log"
        logged optimizer_step_fp8lmkernel${SUFFIX:-}_h200 120 optimizer_step.py --lists gpt_1b \
          --configs flashoptim,flashoptim_fp8lmstates,flashoptim_fp8lmstates_inductor ;;
      buckets)
        logged hf_clients_llama_buckets_batch1_h200 200 hf_clients.py --model llama --attention is_causal --batch 1 \
          --seq 1024 --clip 0 --configs flashoptim,flashoptim+buckets --steps 8 --warmup 3 --log-every 4 ;;
      speed)
        logged hf_clients_llama_fp8lmkernel_h200 540 hf_clients.py --model llama --attention is_causal \
          --configs baseline,flashoptim_fp8+fastaccum+cudagraphs+fp8lmstates,flashoptim_fp8+fastaccum+cudagraphs+fp8lmstates+buckets \
          --steps 40 --log-every 20 --pipelined 20 --profile 2 ;;
    esac
    ;;
  amaxslots)
    # the FP8-LM step's amax atomics spread over AMAX_SLOTS addresses: its GPU tests and the step alone on the 1.2B
    # GPT's tensors; then gradient release where the chunked loss moved the peak off the logits: the Llama at
    # 2 x 4096, regional, checkpointed, its eager loss chunked, with and without release (no clipping)
    PART=tests SUFFIX=_slots bash "$0" fp8lmkernel "$out"
    logged hf_clients_llama_release_chunkedloss_h200 300 hf_clients.py --model llama --attention is_causal --clip 0 \
      --configs flashoptim+regional+checkpoint+chunkedloss,flashoptim_release+regional+checkpoint+chunkedloss \
      --steps 8 --warmup 3 --log-every 4
    ;;
  chunkedloss)
    logged hf_clients_llama_chunkedloss${SUFFIX:-}_h200 540 hf_clients.py --model llama --attention is_causal \
      --configs "${CONFIGS:-baseline,flashoptim_fp8+fastaccum+cudagraphs+fp8lmstates,flashoptim_fp8+fastaccum+cudagraphs+fp8lmstates+chunkedloss,flashoptim,flashoptim+chunkedloss}" \
      --steps 40 --log-every 20 --pipelined 20
    ;;
  bf16scales)
    # the companded states' bf16 group scales (issue 14) with the kernels themselves: every GPU test of the
    # companded and FP8-LM steps, then the step alone on the 1.2B GPT's tensors
    companded_gpu_tests gpu_tests_bf16scales_h200
    tail -6 "$out/gpu_tests_bf16scales_h200.log"
    logged optimizer_step_bf16scales_h200 200 optimizer_step.py --lists gpt_1b --configs torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_fp8lmstates,flashoptim_pypi
    ;;
  fp8grads)
    logged fp8_gradient_check_llama_h200 500 fp8_gradient_check.py --model llama --size full --pretrain 50
    ;;
  nearestscales)
    if [ "${PART:-tests}" = step ]; then
      logged optimizer_step_nearestscales_h200 150 optimizer_step.py --lists gpt_1b --configs torch_fused_fp32,torch_fused_bf16,flashoptim
    else
      # the tests barely load the GPU: beside the gradient check, which times nothing
      companded_gpu_tests gpu_tests_nearestscales_h200 &
      logged fp8_gradient_check_llama_h200 520 fp8_gradient_check.py --model llama --size full --pretrain 50
      wait
      tail -6 "$out/gpu_tests_nearestscales_h200.log"
    fi
    ;;
  fp8kernels)
    export TORCH_LOGS=output_code TORCH_LOGS_OUT="$out/${NAME:-hf_clients_llama2l_kernels_h200}_code.log"
    logged "${NAME:-hf_clients_llama2l_kernels_h200}" 400 hf_clients.py --model llama --layers 2 --attention is_causal \
      --configs "${CONFIGS:-baseline,flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+fastaccum+delayed+cudagraphs}" \
      --steps 30 --warmup 10 --log-every 10 --profile 3 --profile-top 80
    # the code is in its own file; the log keeps the rest
    sed -i '/\[__output_code\]/d' "$out/${NAME:-hf_clients_llama2l_kernels_h200}.log"
    gzip -f "$TORCH_LOGS_OUT"
    ;;
  statefidelity)
    logged state_fidelity_llama_h200 560 state_fidelity.py --model llama --steps "${FIDELITY_STEPS:-300}" \
      --measure-every 25 --candidates "${CANDIDATES:-companded,companded_m_only,companded_v_only,fp8lm,root4_v,sr_v,sr}"
    ;;
  zoo)
    if [ "${PART:-all}" != zoo ]; then
      timeout 200 python -m pytest -v -m gpu tests/test_gpu.py -k "${TESTS:-fp8 or checkpoint or transpose}" 2>&1 \
        | grep -v "^DEBUG" > "$out/${TESTS_NAME:-gpu_tests_zoo_h200}.log"
      tail -4 "$out/${TESTS_NAME:-gpu_tests_zoo_h200}.log"
    fi
    if [ "${PART:-all}" != tests ]; then
      logged "${NAME:-hf_zoo_small_$card}" "${LIMIT:-330}" hf_zoo.py --device cuda --size small \
        --models "${MODELS:-qwen3,gemma3,phi3,falcon,mixtral}" --steps "${STEPS:-12}" --lr "${LR:-1e-3}" \
        --rows "${ROWS:-stock,flashoptim,flashoptim_fp8}" --profile "${PROFILE:-0}"
    fi
    ;;
  fp8sizes)
    logged "${NAME:-fp8_linear_sizes_h200}" "${LIMIT:-300}" fp8_linear.py --blocks none \
      --shapes "${SHAPES:-4096x1024x1024,4096x1024x2816,4096x2816x1024,4096x2048x2048,4096x2048x5632,4096x5632x2048,8192x1024x2816,8192x2048x5632,16384x1024x2816,16384x2048x2048}" \
      --peers bf16,flashoptim_fast_accum,bf16_cudagraphs,flashoptim_fast_accum_cudagraphs
    ;;
  inplace)
    case ${PART:-tests} in
      tests)
        companded_gpu_tests gpu_tests_inplace_h200 570
        tail -4 "$out/gpu_tests_inplace_h200.log" ;;
      batch1)
        logged optimizer_step_inplace_h200 120 optimizer_step.py --lists gpt_1b --configs flashoptim,flashoptim_fp8lmstates
        logged hf_clients_llama_inplace_batch1_h200 240 hf_clients.py --model llama --attention is_causal --batch 1 \
          --seq 1024 --clip 0 --configs flashoptim,flashoptim+copygrads --steps 8 --warmup 3 --log-every 4 ;;
      speed)
        logged hf_clients_llama_inplace_h200 540 hf_clients.py --model llama --attention is_causal \
          --configs baseline,flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+fastaccum+cudagraphs+copygrads \
          --steps 40 --log-every 20 --pipelined 20 --profile 2 ;;
      recompute)
        logged hf_clients_llama_recompute_h200 560 hf_clients.py --model llama --attention is_causal \
          --configs flashoptim,flashoptim+recompute,flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+fastaccum+cudagraphs+recompute \
          --steps 40 --log-every 20 --pipelined 20 ;;
    esac
    ;;
  rowwise)
    case ${PART:-tests} in
      tests)
        timeout 300 python -m pytest -v -m gpu tests/test_gpu.py tests/test_fp8_transpose.py \
          -k "${TESTS:-rowwise or rescaled_rows or cast_by_columns or cast_transposes or cudagraphs_train_step or kept_zero or transposes_in_its_own_kernel or every_token_count or attention_projections}" 2>&1 \
          | grep -v "^DEBUG" > "$out/gpu_tests_rowwise${SUFFIX:-}_$card.log"
        tail -4 "$out/gpu_tests_rowwise${SUFFIX:-}_$card.log" ;;
      linears)
        logged fp8_linear_rowwise_h200 400 fp8_linear.py --blocks none \
          --shapes 8192x2048x2048,8192x2048x5632,8192x5632x2048,4096x1024x1024 \
          --peers bf16,flashoptim_fast_accum,flashoptim_rowwise,flashoptim_rowwise_fast_accum,torchao,torchao_rowwise ;;
      speed)
        logged "hf_clients_llama_rowwise${SUFFIX:-}_$card" "${LIMIT:-560}" hf_clients.py --model llama --attention is_causal \
          --configs "${CONFIGS:-baseline,flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+rowwise+fastaccum+cudagraphs}" \
          --steps 40 --log-every 20 --pipelined 20 --profile "${PROFILE:-0}" --profile-top "${PROFILE_TOP:-25}" ;;
      profile)
        logged "hf_clients_llama_rowwise_profile${SUFFIX:-}_$card" 560 hf_clients.py --model llama \
          --attention is_causal --configs flashoptim_fp8+rowwise+fastaccum+cudagraphs --steps 20 --log-every 10 \
          --pipelined 20 --profile 3 ;;
      layers2)
        logged "hf_clients_llama2l_rowwise_profile${SUFFIX:-}_$card" "${LIMIT:-400}" hf_clients.py --model llama --layers 2 \
          --attention is_causal --configs "${CONFIGS:-flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+rowwise+fastaccum+cudagraphs}" \
          --steps 30 --log-every 10 --pipelined 20 --profile 3 --profile-top 90 ;;
    esac
    ;;
  rowwisecompile)
    for config in flashoptim_fp8+fastaccum+cudagraphs flashoptim_fp8+rowwise+fastaccum+cudagraphs; do
      TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) logged "hf_clients_llama2l_compile_${config//+/_}_$card" "${LIMIT:-200}" \
        hf_clients.py --model llama --layers 2 --attention is_causal --configs "$config" --steps 10 --log-every 5
    done
    ;;
  division)
    for part in ${PART:-tests layers2}; do
      case $part in
        tests)
          timeout 260 python -m pytest -v -m gpu tests/test_gpu.py tests/test_fp8_delayed.py tests/test_fp8_formats.py \
            -k "token_count or fp8 or rowwise or transpose or spec or default_division or attention_projections" 2>&1 \
            | grep -v "^DEBUG" > "$out/gpu_tests_division_$card.log"
          tail -4 "$out/gpu_tests_division_$card.log" ;;
        layers2)
          logged "hf_clients_llama2l_division_profile_$card" 330 hf_clients.py --model llama --layers 2 \
            --attention is_causal --steps 30 --log-every 10 --pipelined 20 --profile 3 --profile-top 60 --configs \
            flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+fastaccum+cudagraphs+exactdiv,flashoptim_fp8+rowwise+fastaccum+cudagraphs,flashoptim_fp8+rowwise+fastaccum+cudagraphs+exactdiv ;;
        speed)
          logged "hf_clients_llama_division_$card" "${LIMIT:-580}" hf_clients.py --model llama --attention is_causal \
            --configs "${CONFIGS:-baseline,flashoptim_fp8+fastaccum+cudagraphs,flashoptim_fp8+rowwise+fastaccum+cudagraphs}" \
            --steps 40 --log-every 20 --pipelined 20 ;;
      esac
    done
    ;;
  fp8seeds)
    timeout 250 python -m pytest -v -m gpu tests/test_gpu.py -k "e4m3 or fp8 or rowwise or transpose" 2>&1 \
      | grep -v "^DEBUG" > "$out/gpu_tests_fp8seeds${SUFFIX:-}_$card.log" &
    bash "$0" hfllamaseeds "$out"
    wait
    tail -3 "$out/gpu_tests_fp8seeds${SUFFIX:-}_$card.log"
    ;;
  fp8drift)
    # the GPU tests of the FP8 pass (among them the transposed operands and rank-3 einsums of the thirty-sixth
    # session) beside the gradients' SQNR against fp32 after 50, 150 and 300 baseline steps
    timeout 250 python -m pytest -v -m gpu tests/test_gpu.py tests/test_fp8_delayed.py tests/test_fp8_formats.py \
      -k "token_count or fp8 or rowwise or transpose or spec or default_division or attention_projections or einsums" 2>&1 \
      | grep -v "^DEBUG" > "$out/gpu_tests_fp8drift_$card.log" &
    logged "fp8_gradient_trajectory_llama_$card" "${LIMIT:-540}" fp8_gradient_check.py --model llama --size full \
      --pretrain 50,150,300 --rows fp32,fp32_next_batch,bf16,ours_eager,fastaccum_eager,rowwise_eager
    wait
    tail -4 "$out/gpu_tests_fp8drift_$card.log"
    ;;
  multigpu)
    # flash_inductor/launch.py sets these in every process it starts too; exported here for everything else
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    # MGPU_GPUS=2 on a machine of one: the single-GPU reference of a 2-GPU run (its global batch)
    gpus=${MGPU_GPUS:-$(nvidia-smi -L | wc -l)}
    part=${MGPU_PART:-tests}
    case $part in
      tests)
        timeout 590 python -m pytest -v -m gpu tests/test_distributed.py tests/test_fp8_collectives.py \
          tests/test_fp8_all_gather.py 2>&1 | grep -v "^DEBUG" > "$out/gpu_tests_multigpu_${gpus}x_h200.log"
        tail -4 "$out/gpu_tests_multigpu_${gpus}x_h200.log"
        ;;
      124m|1b)
        logged "distributed_${part}_${gpus}x_h200" 590 distributed.py --config "$part" --gpus all --steps 200 \
          --rows ddp_bf16,ddp_fp8,fsdp_bf16,fsdp_fp8
        ;;
      124m_single|1b_single)
        logged "distributed_${part}_${gpus}x_h200" 590 distributed.py --config "${part%_single}" --gpus "$gpus" \
          --steps 200 --rows single
        ;;
      *) echo "unknown MGPU_PART $part"; exit 2 ;;
    esac
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
