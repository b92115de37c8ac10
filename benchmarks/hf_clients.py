"""Real models as clients (issue 14): Hugging Face GPT-2 and Llama, built from a config (random init,
no download), trained through ``@flash_inductor.train_step`` and the peers, one configuration after
another in one process, each from the same initial weights on the same batches.

Models (``--model``; ``--size tiny`` gives a CPU-sized model of the same kind, ``--size small`` a
4-layer Llama, hidden 256, MLP 704, on which FP8's loss gap shows on the CPU):
    gpt2   GPT2LMHeadModel, GPT-2 small (124M: 12 x 768, vocabulary 50257, tied lm_head, Conv1D)
    llama  LlamaForCausalLM from a LlamaConfig: hidden 2048, 16 layers, MLP 5632, 32 heads, vocabulary
           32000, context 4096 (953M parameters)
    gpt    benchmarks/train_gpt.py's own GPT, 124m shape (86M with its 256-byte vocabulary)
Dropout off, SDPA attention, no KV cache. Data: the Python standard library's ``*.py`` files as
bytes (train_gpt.py's corpus); a byte is its token id (every vocabulary here has 256 or more).

Configurations (``--configs``):
    baseline            fp32 params, torch AdamW (fused on CUDA), bf16 autocast
    baseline_fp8        baseline with our FP8 linears (the backend's pass, no prepare): torchao_float8's
                        setup with our rewrite, an ablation of FP8's loss gap
    flashoptim          @flash_inductor.train_step: bf16 + 24-bit split masters, 8-bit states
    flashoptim_fp8      flashoptim + FP8 (tensorwise) linears; embeddings and lm_head excluded
    flashoptim_fp8_fp32states  flashoptim_fp8 with fp32 optimizer states (state_bits=None): an ablation
                        of FP8's loss gap
    flashoptim_release  flashoptim with gradient release (no clipping: it cannot clip globally)
    flashoptim_pypi     peer: the ``flashoptim`` package's FlashAdamW (24-bit) on a bf16 model
                        (its cast_model); CUDA only
    torchao_float8      peer: torchao's convert_to_float8_training (lm_head excluded), fp32
                        masters, fused AdamW, bf16 autocast; off CUDA its emulated GEMMs
    torchao_float8_rowwise  the same with torchao's "rowwise" recipe (the peer of +rowwise)
A flashoptim row takes modifiers, backend or ``prepare`` options joined to its name by "+":
    +fp32act            fp32 activations (prepare's fp32_activations=True: embeddings return fp32), the
                        forward under bf16 autocast: the baseline's activation precision
    +cudagraphs         the model's forward and backward as CUDA graphs (the backend's cudagraphs=True)
    +fp32states         fp32 optimizer states (prepare's state_bits=None; masters stay split)
    +fp8lmstates        FP8-LM's optimizer states (prepare's state_format="fp8lm": e4m3 first moment and fp16
                        second moment, a scale per tensor; 8.0 B/param where the companded 8-bit states take 7.1)
    +masters32          32-bit masters (prepare's master_weight_bits=32: an int16 error term)
    +fastaccum          the FP8 forward GEMMs in the tensor cores' fast accumulation (fp8_fast_accum=True),
                        torchao's default for that GEMM
    +delayed            FP8 rows: delayed scaling (fp8="delayed"; scales from amax histories, so a cast needs no
                        pass over its tensor before it)
    +e4m3grads          FP8 rows: the output gradient cast to e4m3 instead of e5m2 (fp8_e4m3_gradients=True), as
                        row-wise scaling casts it, at tensorwise's speed
    +rowwise            FP8 rows: row-wise scaling (fp8="rowwise"; every GEMM operand e4m3 with a power-of-two
                        scale per row, torchao's "rowwise" recipe)
    +tensorwisedw       with +rowwise: the weight gradient's GEMM with one scale per operand, from the row-wise casts
                        (fp8_tensorwise_weight_gradient=True): no pass over the tokens' columns
    +attn0bf16          FP8 rows: the first layer's attention projections kept in bf16 too (FIRST_ATTENTION)
    +regional           train_step's regional=True: the decoder layers compiled one by one, the rest eager
                        (with flashoptim_release: each layer's gradients applied and freed as its backward ends)
    +checkpoint         Hugging Face's activation checkpointing (gradient_checkpointing_enable, non-reentrant):
                        the layers' forward recomputed in backward, so the peak comes in backward
    +eager              the backend's compiler="eager": the same graphs after the same passes, run by aten's
                        kernels instead of Inductor's (a check of what Inductor's code does to training)
    +nocse              the pass fp8_transpose_cse switched off (each FP8 linear transposes its own input)
    +recomputedscales   the pass fp8_scales_stored switched off: each cast kernel recomputes its FP8 scale for
                        every element it casts, as before the forty-first session
    +buckets            flat buckets of at most 2**26 elements (prepare's bucket_numel): the step lands the
                        gradients bucket by bucket, holding them twice for one bucket only
    +chunkedloss        the lm_head and its cross-entropy 1024 rows at a time (loss_chunk_rows=1024): the fp32
                        logits never exist whole (with +regional, whose loss is eager, the Llama's loss calls
                        flash_inductor.linear_cross_entropy on its last hidden state itself)
    +recompute          the backend's recompute_elementwise=True: a norm's output and silu(gate) * up recomputed in
                        the backward instead of saved for its matmuls
    +exactdiv           every fp32 division of the compiled graphs correctly rounded (Inductor's
                        eager_numerics.division_rounding, which the backend set for FP8 model graphs before the
                        thirty-fourth session; now Triton's approximate division, as in a stock torch.compile)
    +multikernel        Inductor's triton.multi_kernel=1: each reduction compiled twice, looped and persistent (a
                        whole row in one block, read once where the looped one reads it once per loop), and the
                        faster picked on the GPU at run time (row-wise's casts read each row two or three times);
                        each pick is printed with both forms' timings
    +copygrads          the step copies every gradient into the flat buffers before its kernel runs, as it did
                        before the hand-written kernel read them where the backward left them (an A/B of that)
    +emulate_NAME       fp32 states (as +fp32states) rounded after every step through the format NAME of
                        state_candidates.py (e.g. root4_v): a state format's effect on training, measured
                        before its kernels exist
e.g. ``flashoptim_fp8+fp32act+cudagraphs``. The baseline takes two:
    +foreach            torch AdamW's foreach implementation instead of the fused one: the same arithmetic
                        rounded in another order, so the loss moves only by how training amplifies rounding
                        (the resolution of comparing two rows of one seed)
    +checkpoint         as above
The flashoptim rows compile the whole step (train_step); the others compile the forward and the
loss (``torch.compile``, Inductor) and run backward, clipping and the optimizer step eagerly.
Peers are skipped with a note when their package is missing or does not apply. Every row: AdamW
lr (``--lr``), betas (0.9, 0.95), weight decay 0.1, a linear warm-up over ``--lr-warmup`` steps
then cosine decay to 10%, gradients clipped to norm ``--clip`` (``clip_grad_norm_`` in the step,
before ``opt.step()``; also for prepared optimizers, whose gradients are views of the flat buffer).

Measured per row: first-step seconds (compile), median step ms after ``--warmup`` steps and
tokens/s; on CUDA: the start-up peak (``max_memory_allocated`` over the warm-up steps, build and
compile included), the steady-state peak (peak statistics reset after the warm-up, max over the
timed steps), the bytes allocated between steps (after ``zero_grad``, synchronized; their
maximum over the timed steps), all above the allocation before the row; ``memory_report``'s bytes
by component; the loss of every step and the mean of the last 50; the graphs compiled and the CUDA
graphs skipped and recorded while training, while ``--pipelined`` steps ran and while ``--profile``
steps ran (a step back to back that compiles or records is not a replay). Between rows everything is freed
(``torch._dynamo.reset()``, ``empty_cache``) and the allocation is checked against the first
row's starting point.

    python benchmarks/hf_clients.py --model gpt2 --size tiny --steps 20 --device cpu     # CPU smoke run
    python benchmarks/hf_clients.py --model llama --size small --device cpu --configs baseline,flashoptim,flashoptim_fp8
    python benchmarks/hf_clients.py --model llama --size small --device cpu --configs flashoptim_fp8 --fp8-exclude '*.mlp.*'
    python benchmarks/hf_clients.py --model llama --layers 2 --attention is_causal --steps 30 --profile 3 --profile-top 80 \\
        --configs baseline,flashoptim_fp8+fastaccum+cudagraphs   # CUDA: one layer's kernels, the full model's shapes

    python benchmarks/hf_clients.py --model gpt2 --out benchmarks/results/hf_clients_gpt2_h200.json
    python benchmarks/hf_clients.py --model llama --configs baseline,flashoptim,flashoptim_fp8 \\
        --out benchmarks/results/hf_clients_llama_h200.json
    python benchmarks/hf_clients.py --model gpt2 --configs flashoptim --snapshot benchmarks/results/snapshots

``--profile N`` (CUDA): after training, N more steps timed and then profiled (``gpu_profile.step_profile``):
wall time against GPU busy time, the top kernels and CPU operators per step.

``--snapshot DIR`` (CUDA): instead of training, each configuration records the allocator's history
over build (prepare) + 3 steps and writes what is alive between steps, grouped by the code that
allocated it (``analyse_snapshot``), compared with ``memory_report`` and with the tensors Python
can reach (``gc``), and what was alive at the peak of steps 2-3 (``peak_blocks``: the trace replayed,
when ``--snapshot-entries`` held all of it): ``DIR/{model}_{config}_snapshot.txt`` and ``.json``, plus
the raw snapshot ``.pickle`` when it is under 15 MiB (for https://pytorch.org/memory_viz).
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import math
import pathlib
import pickle
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import flash_inductor
from flash_inductor import triton_adam

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpu_profile import print_profile, step_profile  # noqa: E402
from snapshot_analysis import analyse_blocks, analyse_snapshot, format_analysis, live_blocks, peak_blocks, python_tensor_storages  # noqa: E402
from state_candidates import CANDIDATES as STATE_CANDIDATES  # noqa: E402
from state_candidates import rounding_after  # noqa: E402
from train_gpt import (  # noqa: E402
    GPT,
    Setup,
    Skip,
    batch,
    git_commit,
    load_corpus,
    peer_memory,
    print_aligned,
    release_memory,
    synchronize,
    timed_step,
    timing,
    train_starts,
    write_json,
)
from train_gpt import SIZES as GPT_SIZES  # noqa: E402

try:
    import transformers
except ImportError:  # only --model gpt runs without it
    transformers = None

# ---------------------------------------------------------------------------------------- models

# model -> {size: (defaults: batch, seq, lr)}; shapes in build_model
DEFAULTS = {
    "gpt2": {"full": (8, 1024, 6e-4), "tiny": (4, 64, 3e-3)},
    "llama": {"full": (2, 4096, 3e-4), "small": (8, 128, 1e-3), "tiny": (4, 64, 3e-3)},
    "gpt": {"full": (16, 1024, 6e-4), "tiny": (4, 64, 3e-3)},
}
# Module-name patterns of the FP8 rows' excluded layers (the first and last: embeddings, lm_head;
# GPT-2's lm_head is the token embedding's weight, tied).
FP8_EXCLUDE = {"gpt2": ("transformer.wte", "lm_head"), "llama": ("lm_head",), "gpt": ("tok_embed", "pos_embed", "lm_head")}
# The first layer's attention projections, which +attn0bf16 keeps in bf16 too: the gradients that part
# furthest from fp32's late in a run, in every format (docs/benchmarks.md, thirty-seventh session).
FIRST_ATTENTION = {"gpt2": ("transformer.h.0.attn.*",), "llama": ("model.layers.0.self_attn.*",),
                   "gpt": ("blocks.0.qkv", "blocks.0.proj")}


# --attention is_causal: transformers' SDPA attention under a name without a mask function, so that it
# builds no mask and SDPA takes is_causal=True (flash attention), as transformers itself does outside
# Dynamo. Under Dynamo, before torch 2.14, transformers keeps the explicit causal mask
# (masking_utils._ignore_causal_mask_sdpa), which SDPA's flash kernel cannot take. Only for batches
# without padding (these benchmarks have none).
CAUSAL_SDPA = "sdpa_is_causal"


def attention_implementation(attention):
    if attention == "mask":
        return "sdpa"
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def model_config(name, size, seq, attention="mask", layers=None):
    """The model's config: a transformers config, or train_gpt's GPTConfig for ``gpt``; ``layers``
    replaces the size's number of layers (transformers models)."""
    if name == "gpt":
        return dataclasses.replace(GPT_SIZES["124m" if size == "full" else "tiny"][0], seq=seq)
    if transformers is None:
        raise SystemExit(f"--model {name} needs transformers (pip install -e '.[clients]')")
    common = dict(use_cache=False, attn_implementation=attention_implementation(attention))
    if name == "gpt2":
        shape = {} if size == "full" else dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
        shape |= {} if layers is None else dict(n_layer=layers)
        return transformers.GPT2Config(**shape, n_positions=max(seq, 1024 if size == "full" else seq),
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    shape = {
        "full": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32, vocab_size=32000),
        # CPU-sized, big enough for FP8's loss gap to show (docs/benchmarks.md, the Llama's FP8 loss)
        "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, vocab_size=1024,
                      bos_token_id=0, eos_token_id=0),
        "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=1000, bos_token_id=0, eos_token_id=0),
    }[size]
    shape |= {} if layers is None else dict(num_hidden_layers=layers)
    return transformers.LlamaConfig(**shape, max_position_embeddings=seq, **common)


def build_model(name, config):
    if name == "gpt":
        return GPT(config)
    return (transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM)(config)


def vocab_size(name, config):
    return config.vocab if name == "gpt" else config.vocab_size


def lm_loss(model, x, y, chunk_rows=0):
    if chunk_rows:  # an eager loss (a regional step) chunked by hand, as the pass chunks a compiled one
        hidden = model.model(x).last_hidden_state
        return flash_inductor.linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, None, y.flatten(),
                                                   chunk_rows=chunk_rows)
    out = model(x)
    logits = getattr(out, "logits", out)  # a transformers ModelOutput, or train_gpt's GPT's tensor
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


# ------------------------------------------------------------------------------- configurations


def adamw_args(args):
    return dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


def loss_function(model, use_autocast, chunk_rows=0):
    """(x, y) -> the model's next-token loss, under bf16 autocast or not (``chunk_rows``: ``lm_loss``'s).
    The peers compile this whole function, the loss with the model, as the flashoptim rows' train step does."""

    def loss(x, y):
        with torch.autocast(x.device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext():
            return lm_loss(model, x, y, chunk_rows)

    return loss


def make_step(loss_fn, params, optimizer, clip):
    """forward and loss (``loss_fn``: compiled or not), backward, clipping to ``clip`` (0: none),
    the optimizer's step, zero_grad."""
    params = list(params)

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def compiled(fn, args):
    return fn if args.no_inductor else torch.compile(fn)


def checkpoint_activations(model):
    """Hugging Face's activation checkpointing (each decoder layer's forward recomputed in backward),
    torch's non-reentrant checkpoint."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"+checkpoint: {type(model).__name__} is not a Hugging Face model (gradient_checkpointing_enable)")
    non_reentrant = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers; the other name is its deprecated alias
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)


def build_baseline(model, args, fused=None, activation_checkpointing=False):
    """``fused=None``: torch's fused AdamW on CUDA, else its default."""
    if activation_checkpointing:
        checkpoint_activations(model)
    fused = args.device.startswith("cuda") if fused is None else fused
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args), fused=fused)
    step = make_step(compiled(loss_function(model, True), args), model.parameters(), opt, args.clip)
    return Setup(model, opt, step, autocast=True), args.clip


def build_flashoptim(model, args, gradient_release=False, fp32_activations=False, activation_checkpointing=False,
                     **options):
    """``fp32_activations=True`` runs the forward under autocast, which it needs."""
    if activation_checkpointing:
        checkpoint_activations(model)
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args))
    clip = 0 if gradient_release else args.clip
    if args.no_inductor:
        options["compiler"] = "eager"
    # A regional step's loss is eager: chunked here, as loss_chunk_rows would chunk a compiled one
    eager_chunk_rows = options.pop("loss_chunk_rows", 0) if options.get("regional") else 0
    loss = loss_function(model, fp32_activations, eager_chunk_rows)
    step = flash_inductor.train_step(make_step(loss, model.parameters(), opt, clip), model=model, optimizer=opt,
                                     gradient_release=gradient_release, fp32_activations=fp32_activations, **options)
    return Setup(model, opt, step, autocast=fp32_activations, record_fp8="fp8" in options), clip


def fp8_options(args):
    """Our FP8 linears as the flashoptim_fp8 rows take them: tensorwise, ``FP8_EXCLUDE`` and --fp8-exclude
    left out; a smaller model's weights and GEMMs are all under the backend's fp8_min_weight_numel and
    fp8_min_gemm_size: there, every eligible one."""
    every_eligible = {"fp8_min_weight_numel": 0, "fp8_min_gemm_size": 0} if args.size != "full" else {}
    return dict(fp8="tensorwise", fp8_exclude=FP8_EXCLUDE[args.model] + tuple(args.fp8_exclude or ()), **every_eligible)


def build_flashoptim_fp8(model, args, first_attention_bf16=False, **options):
    fp8 = fp8_options(args)
    if first_attention_bf16:
        fp8["fp8_exclude"] += FIRST_ATTENTION[args.model]
    return build_flashoptim(model, args, **{**fp8, **options})  # +delayed, +rowwise replace "tensorwise"


def build_flashoptim_fp8_fp32states(model, args, **options):
    return build_flashoptim_fp8(model, args, state_bits=None, **options)


def build_baseline_fp8(model, args):
    """The baseline with our FP8 linears (the backend's FP8 pass, no ``prepare``): torchao_float8's setup
    with our rewrite in place of torchao's module swap."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args), fused=args.device.startswith("cuda"))
    loss = flash_inductor.compile(loss_function(model, True), **fp8_options(args))
    step = make_step(loss, model.parameters(), opt, args.clip)
    return Setup(model, opt, step, autocast=True, record_fp8=True), args.clip


def build_flashoptim_release(model, args, **options):
    return build_flashoptim(model, args, gradient_release=True, **options)


def build_flashoptim_pypi(model, args):
    try:
        from flashoptim import FlashAdamW, cast_model
    except ImportError as e:
        raise Skip(f"package flashoptim not importable ({e})") from None
    if not args.device.startswith("cuda"):
        raise Skip("flashoptim's FlashAdamW needs CUDA (its quantized states and error bits are Triton kernels)")
    cast_model(model, dtype=torch.bfloat16)
    opt = FlashAdamW(model.parameters(), **adamw_args(args), master_weight_bits=24)
    step = make_step(compiled(loss_function(model, False), args), model.parameters(), opt, args.clip)
    return Setup(model, opt, step, memory=peer_memory), args.clip


def build_torchao_float8(model, args, recipe="tensorwise"):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise Skip(f"torchao.float8 not importable ({e})") from None
    excluded = FP8_EXCLUDE[args.model]

    def eligible(module, name):
        return not any(name.startswith(e) for e in excluded) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and eligible(m, n)]
    if not linears:
        raise Skip("no nn.Linear to convert (GPT-2's projections are transformers' Conv1D, which torchao does not convert)")
    # Off CUDA, torchao emulates its FP8 GEMMs (same casts and scales, fp32 matmuls): the CPU comparison of
    # the two FP8 recipes' numerics.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=not args.device.startswith("cuda"))
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args), fused=args.device.startswith("cuda"))
    step = make_step(compiled(loss_function(model, True), args), model.parameters(), opt, args.clip)
    return Setup(model, opt, step, autocast=True, memory=peer_memory), args.clip


CONFIGURATIONS = {  # name -> builder(model with fp32 params on the device, args) -> (Setup, clip norm or 0)
    "baseline": build_baseline,
    "baseline_fp8": build_baseline_fp8,
    "flashoptim": build_flashoptim,
    "flashoptim_fp8": build_flashoptim_fp8,
    "flashoptim_fp8_fp32states": build_flashoptim_fp8_fp32states,
    "flashoptim_release": build_flashoptim_release,
    "flashoptim_pypi": build_flashoptim_pypi,
    "torchao_float8": build_torchao_float8,
    "torchao_float8_rowwise": functools.partial(build_torchao_float8, recipe="rowwise"),
}


def default_lr_warmup(steps):
    """The LR warm-up when --lr-warmup is not given: a tenth of the steps."""
    return max(1, steps // 10)


def lr_factor(step, warmup, total, floor=0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# Options a row takes after its name, joined by "+": flashoptim_fp8+cudagraphs. A flashoptim row's are
# backend or prepare options, the baseline's torch AdamW's.
MODIFIERS = {
    "cudagraphs": dict(cudagraphs=True),
    "fp32act": dict(fp32_activations=True),
    "fp32states": dict(state_bits=None),
    "fp8lmstates": dict(state_format="fp8lm"),
    "masters32": dict(master_weight_bits=32),
    "fastaccum": dict(fp8_fast_accum=True),
    "delayed": dict(fp8="delayed"),
    "rowwise": dict(fp8="rowwise"),
    "tensorwisedw": dict(fp8_tensorwise_weight_gradient=True),
    "e4m3grads": dict(fp8_e4m3_gradients=True),
    "attn0bf16": dict(first_attention_bf16=True),  # the FP8 rows only
    "regional": dict(regional=True),
    "checkpoint": dict(activation_checkpointing=True),
    "eager": dict(compiler="eager"),
    "nocse": dict(disable=("fp8_transpose_cse",)),
    "recomputedscales": dict(disable=("fp8_scales_stored",)),
    "buckets": dict(bucket_numel=1 << 26),
    "chunkedloss": dict(loss_chunk_rows=1024),
    "copygrads": dict(copy_gradients=True),
    "recompute": dict(recompute_elementwise=True),
    "exactdiv": dict(inductor={"eager_numerics.division_rounding": True}),
    "multikernel": dict(inductor={"triton.multi_kernel": 1}),
    # fp32 states rounded after every step through a format of state_candidates.py: its effect on training
    **{f"emulate_{name}": dict(state_bits=None, emulate_states=name) for name in STATE_CANDIDATES},
}
BASELINE_MODIFIERS = {"foreach": dict(fused=False), "checkpoint": dict(activation_checkpointing=True)}


def log_multi_kernel_picks():
    """Print Inductor's multi-kernel choices (+multikernel): each reduction's forms (persistent, looped) with
    their timings on the GPU at the first run and the one kept (Inductor logs them at debug level)."""
    logger = logging.getLogger("torch._inductor.codegen.multi_kernel")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("    multi-kernel: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def parse_configuration(name):
    """(builder, options of the modifiers) of a configuration name, or ValueError saying why not."""
    base, *modifiers = name.split("+")
    if base not in CONFIGURATIONS:
        raise ValueError(f"unknown configuration {base!r}; choose from {list(CONFIGURATIONS)}")
    ours = base.startswith("flashoptim") and base != "flashoptim_pypi"
    accepted = MODIFIERS if ours else BASELINE_MODIFIERS if base == "baseline" else {}
    if modifiers and not accepted:
        raise ValueError(f"{name}: modifiers are options of our backend (the flashoptim rows) or of the baseline's AdamW")
    unknown = [m for m in modifiers if m not in accepted]
    if unknown:
        raise ValueError(f"{name}: unknown modifier(s) {unknown} for {base}; choose from {list(accepted)}")
    options = {}
    for modifier in modifiers:
        options.update(accepted[modifier])
    return CONFIGURATIONS[base], options


UNREADABLE_GRADIENT = triton_adam.unreadable_gradient


def _copy_every_gradient(grad, view):
    return "+copygrads"


def build(name, args, device):
    """The configuration's Setup, its clip norm and its LR schedule, from the same initial weights."""
    builder, options = parse_configuration(name)
    emulated_states = options.pop("emulate_states", None)
    # rows run one after the other: each sets how the step takes its gradients (+copygrads)
    triton_adam.unreadable_gradient = _copy_every_gradient if options.pop("copy_gradients", False) else UNREADABLE_GRADIENT
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = build_model(args.model, args.config)
    setup, clip = builder(model, args, **options)
    if emulated_states:
        setup.step = rounding_after(setup.step, setup.optimizer, emulated_states)
    schedule = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, lambda s: lr_factor(s, args.lr_warmup, args.steps))
    return setup, clip, schedule


# ---------------------------------------------------------------------------------------- memory


def memory_components(setup):
    """Bytes by component: ``memory_report`` (gradients: what they take when held), a peer's own."""
    if setup.memory is not None:
        return dict(setup.memory(setup.model, setup.optimizer))
    return dict(flash_inductor.memory_report(setup.model, setup.optimizer).bytes)


def allocated(device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def warm_up_cublas(device):
    """cuBLAS's workspaces (one per thread that runs a GEMM: ours and autograd's) are allocated at the
    first matmul and kept; made here, they are part of every row's starting allocation."""
    a = torch.randn(64, 64, device=device, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        (a.to(dtype) @ a.to(dtype)).float().sum().backward()
    a.grad = None


def targets(runs, num_params, seeds=None):
    """Issue 14's targets, per flashoptim row, against the baseline row (None where not measured);
    the loss against the baseline's mean over seeds where both ran several (``seed_summary``).
    Runs of other seeds give none; runs that shared the GPU no speed-up."""
    base = runs.get("baseline")
    if base is None:
        return {}
    saving = 0.9 * (16 - 7.13) * num_params
    out = {}
    for name, r in runs.items():
        if not name.startswith("flashoptim") or name == "flashoptim_pypi" or parse_run_key(name)[1]:
            continue
        t = {}
        if r["steady_peak_bytes"] is not None:
            t["steady_peak_at_most_bytes"] = base["steady_peak_bytes"] - saving
            t["steady_peak_ok"] = r["steady_peak_bytes"] <= t["steady_peak_at_most_bytes"]
            t["startup_peak_ok"] = r["startup_peak_bytes"] <= 1.1 * r["steady_peak_bytes"]
            if r.get("steady_reserved_bytes") is not None:  # measured since the twenty-fifth session
                t["startup_reserved_ok"] = r["startup_reserved_bytes"] <= 1.1 * r["steady_reserved_bytes"]
            t["between_steps_ok"] = abs(r["between_steps_vs_report"] - 1) <= 0.05
        if not r.get("shared_gpu") and not base.get("shared_gpu"):
            t["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            if "pipelined_tokens_per_s" in r and "pipelined_tokens_per_s" in base:
                t["speedup_pipelined"] = r["pipelined_tokens_per_s"] / base["pipelined_tokens_per_s"]
        t["last50_loss_vs_baseline"] = r["last50_loss"] / base["last50_loss"] - 1
        over_seeds = (seeds or {}).get(name, {}).get("mean_vs_baseline_mean")
        if over_seeds is not None:
            t["last50_loss_vs_baseline_over_seeds"] = over_seeds
        t["loss_ok"] = abs(t["last50_loss_vs_baseline"] if over_seeds is None else over_seeds) <= 0.01
        out[name] = t
    return out


# -------------------------------------------------------------------------------------- training


@functools.cache
def _counted_cuda_graph_recordings():
    """A list whose one element counts the CUDA graphs that cudagraph trees record from now on: a
    replayed step records none; a step whose graph is recorded again (new input addresses, a changed
    path through the tree) records one per graph."""
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    count, record = [0], CUDAGraphTreeManager.record_function

    def counted(self, *args, **kwargs):
        count[0] += 1
        return record(self, *args, **kwargs)

    CUDAGraphTreeManager.record_function = counted
    return count


def compile_counters():
    """What has been compiled and recorded so far: Dynamo's graphs, CUDA graphs that Inductor skipped
    (the reason is in its log) and those recorded; a row's steps differ by what they add."""
    from torch._dynamo.utils import counters

    return dict(graphs_compiled=counters["stats"]["unique_graphs"], cuda_graphs_skipped=counters["inductor"]["cudagraph_skips"],
                cuda_graphs_recorded=_counted_cuda_graph_recordings()[0])


def counters_since(before):
    """``compile_counters()`` minus ``before``, printed on one line."""
    now = compile_counters()
    added = {k: now[k] - before[k] for k in now}
    print("    " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in added.items()), flush=True)
    return added


def run_configuration(name, corpus, args, device, start_bytes):
    """Build, train and measure one configuration; what it allocated is freed by the caller."""
    cuda = device.type == "cuda"
    starts = train_starts(len(corpus.train), args.steps, args.batch, args.seq, args.seed).to(device)
    release_memory(device)
    before = allocated(device)
    reserved_before = torch.cuda.memory_reserved(device) if cuda else None
    if cuda:
        left = before - start_bytes - starts.nbytes
        print(f"  allocated before: {before / 2**20:.1f} MiB (first row's start: {start_bytes / 2**20:.1f} MiB"
              + (f"; {left / 2**20:.1f} MiB left by an earlier row)" if abs(left) >= 2**20 else ")"))
        torch.cuda.reset_peak_memory_stats(device)
    counted = compile_counters()
    setup, clip, schedule = build(name, args, device)
    # Recording the FP8 decisions turns Inductor's FX graph and AOT caches off for the first step: runs
    # sharing the GPU (hfllamaseeds' seeds, staged) skip it, so later ones load the first one's graphs.
    setup.record_fp8 = setup.record_fp8 and not args.shared_gpu
    r = dict(clip=clip, train_loss=[], step_s=[], between_steps_bytes=[], fp8_decisions=None,
             allocated_before_bytes=before, startup_peak_bytes=None, steady_peak_bytes=None,
             startup_reserved_bytes=None, steady_reserved_bytes=None)
    for i in range(args.steps):
        if i == args.warmup and cuda:
            r["startup_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
            r["startup_reserved_bytes"] = torch.cuda.max_memory_reserved(device) - reserved_before
            # What start-up cached and left free goes back, so the steady reserved peak is what the
            # steps hold; with CUDA graphs that is the footprint, as replays allocate nothing from the
            # graphs' pool and the allocated peak misses it.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        x, y = batch(corpus.train, starts[i], args.seq)
        loss, seconds, decisions = timed_step(setup, x, y, device, first=i == 0)
        if i == 0:
            r["fp8_decisions"] = decisions
        r["step_s"].append(seconds)
        r["train_loss"].append(loss)
        schedule.step()
        if i >= args.warmup and cuda:
            r["between_steps_bytes"].append(allocated(device) - before)
        if (i + 1) % args.log_every == 0 or i == 0:
            print(f"  step {i + 1:5d}  loss {loss:.4f}  {r['step_s'][-1] * 1e3:9.1f} ms", flush=True)
        if not math.isfinite(loss):
            print(f"  loss is {loss} at step {i + 1}: stopping this configuration")
            break
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - before
        if r["startup_peak_bytes"] is None:  # no step after the warm-up: everything was start-up
            r["startup_peak_bytes"] = peak
        else:
            r["steady_peak_bytes"] = peak
            r["steady_reserved_bytes"] = torch.cuda.max_memory_reserved(device) - reserved_before
        print(f"  peak {peak / 2**20:.0f} MiB ({'steady' if r['steady_peak_bytes'] else 'start-up'}), start-up "
              f"{r['startup_peak_bytes'] / 2**20:.0f} MiB", flush=True)
        if r["steady_reserved_bytes"] is not None:
            print(f"  reserved: start-up {r['startup_reserved_bytes'] / 2**20:.0f} MiB, steady "
                  f"{r['steady_reserved_bytes'] / 2**20:.0f} MiB", flush=True)
    r.update(timing(r["step_s"], args.warmup, args.batch * args.seq))
    r["counters"] = {"training": counters_since(counted)}
    if args.pipelined:
        counted = compile_counters()
        r.update(pipelined_timing(setup, corpus, starts, args, device))
        r["counters"]["pipelined"] = counters_since(counted)
    if args.profile and cuda:
        x, y = batch(corpus.train, starts[-1], args.seq)
        counted = compile_counters()
        r["profile"] = step_profile(lambda: setup.step(x, y).item(), calls=args.profile, top=args.profile_top)
        print_profile(r["profile"])
        r["counters"]["profile"] = counters_since(counted)
    components = memory_components(setup)
    num_params = sum(p.numel() for p in setup.model.parameters())
    without_grads = sum(v for k, v in components.items() if k != "grads")
    between = max(r["between_steps_bytes"]) if r["between_steps_bytes"] else None
    last = r["train_loss"][-50:]
    r.update(num_params=num_params, memory_bytes=components, memory_per_param={k: v / num_params for k, v in components.items()},
             report_without_grads_bytes=without_grads, between_steps_max_bytes=between,
             between_steps_vs_report=None if between is None else between / without_grads,
             last50_loss=sum(last) / len(last))
    return r


def pipelined_timing(setup, corpus, starts, args, device):
    """``--pipelined`` more steps back to back, the loss read after the last one only, as a loop that
    logs every few steps runs: seconds per step over them, and tokens/s. Each step's CPU work (guards,
    launches) then overlaps the GPU work of the step before, where ``timed_step`` (a synchronized
    start, the loss read at the end) exposes it. Only the last loss is kept: with CUDA graphs a
    step's outputs live in the graph's memory, which the next step overwrites."""
    batches = [batch(corpus.train, starts[i % len(starts)], args.seq) for i in range(args.pipelined)]
    synchronize(device)
    t0 = time.perf_counter()
    for x, y in batches:
        loss = setup.step(x, y)
    loss.item()
    seconds = (time.perf_counter() - t0) / args.pipelined
    print(f"  pipelined: {args.pipelined} steps, {seconds * 1e3:.1f} ms per step", flush=True)
    return dict(pipelined_step_s=seconds, pipelined_tokens_per_s=args.batch * args.seq / seconds)


# ---------------------------------------------------------------------------------------- snapshot


def snapshot_configuration(name, corpus, args, device, folder):
    """Record the allocator's history over build + 3 steps; write what is alive after the third, and
    what was alive at the peak of the second and third (the steady steps, past compile)."""
    starts = train_starts(len(corpus.train), 3, args.batch, args.seq, args.seed).to(device)
    index = device.index or 0  # the snapshot's device_traces are per device
    release_memory(device)
    before = allocated(device)
    existing = [(a, s) for a, s, _ in live_blocks(torch.cuda.memory._snapshot())]
    torch.cuda.memory._record_memory_history(max_entries=args.snapshot_entries, stacks="python")
    setup, _, schedule = build(name, args, device)
    after_build = allocated(device) - before
    for i, rows in enumerate(starts):
        setup.step(*batch(corpus.train, rows, args.seq)).item()
        schedule.step()
        if i == 0:
            steady_from = len(torch.cuda.memory._snapshot()["device_traces"][index])
    gc.collect()
    between = allocated(device) - before
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    report = memory_components(setup)
    analysis = analyse_snapshot(snapshot, report, python_tensor_storages(device.type), exclude=existing)
    analysis.update(allocated_after_build_bytes=after_build, allocated_between_steps_bytes=between,
                    num_params=sum(p.numel() for p in setup.model.parameters()))
    if len(snapshot["device_traces"][index]) < args.snapshot_entries:  # the whole recording: its peak can be replayed
        _, blocks = peak_blocks(snapshot, start=steady_from, device=index)
        analysis["steady_peak"] = analyse_blocks(blocks)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{args.model}_{name}_snapshot"
    text = format_analysis(analysis, f"{args.model} {name}: after build (prepare) {after_build / 2**20:.1f} MiB, "
                                     f"between steps {between / 2**20:.1f} MiB allocated "
                                     f"({between / analysis['num_params']:.3f} B/param)")
    if "steady_peak" in analysis:
        text += "\n\n" + format_analysis(analysis["steady_peak"], f"{args.model} {name}: the peak of steps 2-3, "
                                         "what the recording allocated (blocks from before it not counted)",
                                         moment="at the peak")
    else:
        text += f"\n\nno peak analysis: the trace reached --snapshot-entries ({args.snapshot_entries}), its start is lost"
    pathlib.Path(f"{stem}.txt").write_text(text + "\n")
    write_json(analysis, f"{stem}.json")
    raw = pickle.dumps(snapshot)
    if len(raw) >= 15 * 2**20:  # the device returns files up to 16 MiB: the state alone, without the history
        raw = pickle.dumps({**snapshot, "device_traces": []})
    if len(raw) < 15 * 2**20:
        pathlib.Path(f"{stem}.pickle").write_bytes(raw)
    print(text)
    return analysis


# ---------------------------------------------------------------------------------------- report


def print_table(runs):
    """Every run, its loss against the baseline run of its seed."""
    mib = 2**20

    def m(v):
        return "-" if v is None else f"{v / mib:.0f}"

    header = ("configuration", "first s", "ms/step", "tok/s", "start-up peak", "steady peak", "between", "report",
              "between/report", "last-50 loss", "vs baseline")
    rows = [header]
    for name, r in runs.items():
        ratio = r["between_steps_vs_report"]
        baseline = runs.get(run_key("baseline", r.get("seed", 0)))
        rel = "" if baseline is None else f"{(r['last50_loss'] / baseline['last50_loss'] - 1) * 100:+.2f}%"
        times = ("shared GPU",) * 3 if r.get("shared_gpu") else (
            f"{r['first_step_s']:.1f}", f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}")
        rows.append((name, *times, m(r["startup_peak_bytes"]), m(r["steady_peak_bytes"]), m(r["between_steps_max_bytes"]),
                     m(r["report_without_grads_bytes"]), "-" if ratio is None else f"{ratio:.3f}", f"{r['last50_loss']:.4f}", rel))
    print_aligned(rows)
    print("memory in MiB above each row's starting allocation; report = memory_report without gradients; "
          "shared GPU: trained while other runs shared the GPU (its times are not its own)")


def save_plots(results, folder, prefix=""):
    """``{prefix}loss.png`` (training loss) and ``{prefix}memory.png`` (memory by component and the
    peaks), or a note when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (the JSON has every number; --report-from with --plot makes them later)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs, info = results["runs"], results["info"]
    title = (f"{info['model']} ({info['num_params'] / 1e6:,.0f}M parameters), batch {info['batch']} x {info['seq']}, "
             f"{info['device']}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in runs.items():
        losses = r["train_loss"]
        k = max(1, len(losses) // 50)
        ax.plot(range(1, len(losses) + 1), [statistics.mean(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))],
                label=name, lw=1)
    ax.set(title=title, xlabel="step", ylabel=f"training loss (running mean over {k} steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths = [folder / f"{prefix}loss.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    components = ("weights", "error_terms", "states", "state_scales", "grads")
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 3, 4.5))
    names, bottom = list(runs), [0.0] * len(runs)
    for component in components:
        values = [runs[n]["memory_bytes"].get(component, 0) / 2**30 for n in names]
        ax.bar(names, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    for key, marker in (("steady_peak_bytes", "_"), ("between_steps_max_bytes", "x")):
        if all(runs[n][key] is not None for n in names):
            ax.scatter(names, [runs[n][key] / 2**30 for n in names], marker=marker, s=400, c="k", zorder=3,
                       label=key.removesuffix("_bytes").replace("_", " "))
    ax.set(ylabel="GiB", title=f"memory by component (memory_report) and measured, {info['model']}")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    paths.append(folder / f"{prefix}memory.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    print("wrote " + " and ".join(map(str, paths)))
    return paths


# ------------------------------------------------------------------------------------------ main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEFAULTS), default="gpt2")
    parser.add_argument("--size", choices=("full", "small", "tiny"), default="full",
                        help="small (llama only), tiny: CPU-sized models of the same kind")
    parser.add_argument("--fp8-exclude", nargs="+", metavar="PATTERN",
                        help="more fp8_exclude patterns for flashoptim_fp8 (an ablation: e.g. '*.mlp.*')")
    parser.add_argument("--attention", choices=("mask", "is_causal"), default="mask",
                        help="transformers models' SDPA: mask (as transformers runs it under torch.compile before torch "
                             "2.14: an explicit causal mask) or is_causal (no mask: SDPA's flash kernel)")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS),
                        help=f"comma list of {', '.join(CONFIGURATIONS)}; "
                             f"a flashoptim row takes modifiers: NAME+{'+'.join(MODIFIERS)}; the baseline "
                             f"{'+'.join(BASELINE_MODIFIERS)}")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed, steady-state ones")
    parser.add_argument("--layers", type=int, help="transformers models: this many decoder layers instead of the size's "
                        "(a profile of one layer's kernels compiles in less time)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the model's)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    parser.add_argument("--lr", type=float, help="peak AdamW learning rate (default: the model's)")
    parser.add_argument("--lr-warmup", type=int, help="steps of linear LR warm-up (default: a tenth of --steps)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipelined", type=int, default=0, metavar="N",
                        help="after training, N more steps back to back, the loss read after the last: "
                             "tokens/s without a sync per step")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="other runs share the GPU (several seeds at once): its times are not reported as measured")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-inductor", action="store_true",
                        help="models run eagerly, flashoptim's graphs without Inductor (compiler='eager'): a quick check")
    parser.add_argument("--out", default="hf_clients.json")
    parser.add_argument("--plot", metavar="DIR", help="write {prefix}loss.png and {prefix}memory.png there")
    parser.add_argument("--plot-prefix", help="prefix of the plots' names (default: hf_{model}_)")
    parser.add_argument("--report-from", nargs="+", metavar="JSON",
                        help="no training: merge these result files of one model (a run made in parts) into --out, "
                             "with the targets, the table and the plots (--plot)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="CUDA: after training, profile N more steps (wall vs GPU busy time, top kernels and CPU operators)")
    parser.add_argument("--profile-top", type=int, default=25, metavar="K",
                        help="--profile lists the K longest kernels and operators")
    parser.add_argument("--snapshot", metavar="DIR", help="CUDA: memory snapshot of each configuration instead of training")
    parser.add_argument("--snapshot-entries", type=int, default=100_000, help="allocator events kept by the snapshot")
    args = parser.parse_args(argv)
    for name in args.configs.split(","):
        try:
            parse_configuration(name)
        except ValueError as e:
            parser.error(str(e))
    if args.snapshot and not args.device.startswith("cuda"):
        parser.error("--snapshot needs a CUDA GPU: it records the CUDA caching allocator's history")
    if args.layers is not None and args.model == "gpt":
        parser.error("--layers is for the transformers models (gpt2, llama)")
    if args.size not in DEFAULTS[args.model]:
        parser.error(f"--size {args.size} is for {[m for m, sizes in DEFAULTS.items() if args.size in sizes]}")
    default_batch, default_seq, default_lr = DEFAULTS[args.model][args.size]
    args.batch, args.seq, args.lr = args.batch or default_batch, args.seq or default_seq, args.lr or default_lr
    args.lr_warmup = args.lr_warmup or default_lr_warmup(args.steps)
    args.plot_prefix = f"hf_{args.model}_" if args.plot_prefix is None else args.plot_prefix
    if not args.report_from:
        args.config = model_config(args.model, args.size, args.seq, args.attention, args.layers)
    return args


# What must match for runs of several result files to be compared.
SAME_SETUP = ("model", "size", "num_params", "batch", "seq", "steps", "lr", "lr_warmup", "clip")


def run_key(name, seed):
    """A run's name in merged results: its configuration, and its seed where that is not 0."""
    return name if seed == 0 else f"{name}@seed{seed}"


def parse_run_key(key):
    """(configuration, seed) of a ``run_key``."""
    name, _, seed = key.partition("@seed")
    return name, int(seed or 0)


def merge(paths):
    """The runs of several result files of one setup (a run made in parts, or other seeds) as one
    result. A run made while others shared the GPU (``--shared-gpu``) keeps that mark: its times are
    not its own (its memory is: allocator statistics are per process)."""
    results = None
    for path in paths:
        part = json.loads(pathlib.Path(path).read_text())
        info = part["info"]
        setup = {k: info.get(k) for k in SAME_SETUP} | {"attention": info.get("attention", "mask")}
        # A merged file's runs keep their own seed and mark.
        runs = {}
        for key, r in part["runs"].items():
            r = {"seed": info["seed"], "shared_gpu": info.get("shared_gpu", False), **r}
            runs[run_key(parse_run_key(key)[0], r["seed"])] = r
        if results is None:
            results, first_setup = {**part, "runs": runs, "failed": part.get("failed", {})}, setup
            continue
        if setup != first_setup:
            raise ValueError(f"{path}: another setup than {paths[0]}: "
                             + ", ".join(f"{k} {setup[k]} vs {first_setup[k]}" for k in setup if setup[k] != first_setup[k]))
        results["runs"].update(runs)
        results["skipped"].update(part["skipped"])
        results["failed"].update(part.get("failed", {}))
    return results


# Student's t, two-sided 95% (the 0.975 quantile) by degrees of freedom 1-30; beyond 30 the normal
# quantile with its corrections in 1 / df and 1 / df**2 (Cornish-Fisher) is within 0.01%.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_975(df):
    if df <= len(T_975):
        return T_975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_interval(values):
    """(mean, low, high): the mean of ``values`` (independent seeds) and its two-sided 95% t-interval."""
    mean = statistics.mean(values)
    half = t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def seed_summary(runs):
    """For each configuration run with several seeds: the last-50 losses by seed, their mean and
    standard deviation, and each seed's difference from the baseline run with the same seed (the
    same initial weights and batches), and its mean against the baseline's over the seeds both ran;
    with the mean of the seed-by-seed differences and its 95% interval (how far seeds let a gap of
    this many seeds be told apart from the 1% target), and their median (which one seed's loss
    spike, in the row or in its baseline, does not move)."""
    losses = {}
    for key, r in runs.items():
        name, seed = parse_run_key(key)
        losses.setdefault(name, {})[seed] = r["last50_loss"]
    base = losses.get("baseline", {})
    summary = {}
    for name, by_seed in losses.items():
        if len(by_seed) < 2:
            continue
        values = [by_seed[s] for s in sorted(by_seed)]
        summary[name] = dict(last50_loss_by_seed={str(s): by_seed[s] for s in sorted(by_seed)}, mean=statistics.mean(values),
                             std=statistics.stdev(values),
                             vs_baseline_by_seed={str(s): by_seed[s] / base[s] - 1 for s in sorted(by_seed) if s in base})
        shared = [s for s in sorted(by_seed) if s in base]
        if len(shared) >= 2:
            # Over the seeds both ran: seeds differ by more than the rows do.
            summary[name]["mean_vs_baseline_mean"] = (statistics.mean(by_seed[s] for s in shared)
                                                      / statistics.mean(base[s] for s in shared) - 1)
            gaps = [by_seed[s] / base[s] - 1 for s in shared]
            summary[name]["vs_baseline_by_seed_mean_ci95"] = mean_interval(gaps)
            summary[name]["vs_baseline_by_seed_median"] = statistics.median(gaps)
    return summary


def print_seed_summary(summary):
    if not summary:
        return
    rows = [("configuration", "seeds", "last-50 loss by seed", "mean ± std", "vs baseline's mean (same seeds)",
             "vs baseline, seed by seed", "their mean [95% interval]", "their median")]
    for name, s in summary.items():
        rel = s.get("mean_vs_baseline_mean")
        interval, median = s.get("vs_baseline_by_seed_mean_ci95"), s.get("vs_baseline_by_seed_median")
        rows.append((name, ",".join(s["last50_loss_by_seed"]), " ".join(f"{v:.4f}" for v in s["last50_loss_by_seed"].values()),
                     f"{s['mean']:.4f} ± {s['std']:.4f}", "" if rel is None else f"{rel * 100:+.2f}%",
                     " ".join(f"{v * 100:+.2f}%" for v in s["vs_baseline_by_seed"].values()),
                     "" if interval is None else "{:+.2f}% [{:+.2f}, {:+.2f}]".format(*(v * 100 for v in interval)),
                     "" if median is None else f"{median * 100:+.2f}%"))
    print()
    print_aligned(rows)


def report(results, args):
    """The targets (into ``results``), the table, and the plots under ``--plot``."""
    results["seeds"] = seed_summary(results["runs"])
    results["targets"] = targets(results["runs"], results["info"]["num_params"], results["seeds"])
    print()
    print_table(results["runs"])
    print_seed_summary(results["seeds"])
    for name, t in results["targets"].items():
        print(f"targets {name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))
    for kind in ("skipped", "failed"):
        for name, reason in results.get(kind, {}).items():
            print(f"{kind} {name}: {reason}")
    if args.plot:
        save_plots(results, args.plot, args.plot_prefix)


def main(argv=None):
    args = parse_args(argv)
    if args.report_from:
        results = merge(args.report_from)
        report(results, args)
        write_json(results, args.out)
        print(f"wrote {args.out}")
        return results
    device = torch.device(args.device)
    corpus = load_corpus()
    corpus.train = corpus.train.to(device)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in build_model(args.model, args.config).parameters())
    info = dict(model=args.model, size=args.size, attention=args.attention, num_params=num_params,
                vocab=vocab_size(args.model, args.config),
                batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup, lr=args.lr, lr_warmup=args.lr_warmup,
                clip=args.clip, seed=args.seed, shared_gpu=args.shared_gpu, no_inductor=args.no_inductor, torch=torch.__version__,
                transformers=None if transformers is None else transformers.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M"), commit=git_commit(), corpus=corpus.info,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})")
    print(f"{args.model} ({args.size}): {num_params / 1e6:.1f}M parameters; batch {args.batch} x {args.seq}, "
          f"{args.steps} steps on {info['device']}", flush=True)
    if device.type == "cuda":
        warm_up_cublas(device)
    if any("+multikernel" in name for name in args.configs.split(",")):
        log_multi_kernel_picks()
    start = allocated(device)
    results = dict(info=info, runs={}, skipped={}, failed={}, targets={})
    for name in args.configs.split(","):
        print(f"== {name}", flush=True)
        try:
            if args.snapshot:
                results["runs"][name] = snapshot_configuration(name, corpus, args, device, pathlib.Path(args.snapshot))
            else:
                results["runs"][name] = run_configuration(name, corpus, args, device, start)
        except Skip as e:
            results["skipped"][name] = str(e)
            print(f"  skipped: {e}")
        except Exception as e:  # noqa: BLE001 - a row that fails (out of memory, a compile error) must not end the others
            results["failed"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        release_memory(device)
        write_json(results, args.out)  # after every configuration: a run cut short keeps what it measured
    if not args.snapshot:
        report(results, args)
        write_json(results, args.out)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
