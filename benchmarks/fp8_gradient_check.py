"""Where our FP8 pass and torchao's float8 part on a real model: one step's loss and gradients.

On the H200 the Llama of hf_clients.py trained with our FP8 pass on fp32 masters (``baseline_fp8``)
ended above torchao's float8 on the same setup on both seeds run (+4.00 / +1.26% against +1.86 /
+0.58%; docs/benchmarks.md), while on the CPU's small Llama the two recipes agree. This script
holds one model's weights and one batch fixed and computes the loss and every parameter's gradient
with:

    fp32           no autocast, no FP8, eager: the reference when asked for (else bf16 is)
    fp32_next_batch  fp32 on the next batch: how far apart two batches' gradients are (SGD's noise), the
                   scale against which the other rows' rounding is small or not
    bf16           bf16 autocast, no FP8, eager
    ours_eager     our FP8 pass (``fp8="tensorwise"``, hf_clients' exclusions), aten kernels (compiler="eager")
    ours           the same, compiled by Inductor (what hf_clients' rows run)
    fastaccum_eager  ours_eager with ``fp8_fast_accum=True`` (what the seed rows of hf_clients run; GPU only)
    rowwise_eager  our FP8 pass with ``fp8="rowwise"``, aten kernels
    e4m3grads_eager  ours_eager with ``fp8_e4m3_gradients=True`` (tensorwise, the output gradient in e4m3 as
                   row-wise's is)
    torchao        torchao's ``convert_to_float8_training`` (lm_head excluded), ``torch.compile``

and reports each row's gradient SQNR against the reference per parameter (and ``ours`` against
``ours_eager``): a compiled FP8 layer that computes something else than its eager graph (as
Inductor's amaxes did for FP8-LM's states, sixteenth session) shows as a layer where ``ours`` is
far below ``ours_eager``; a difference of recipe, as one where both are below ``torchao``.
``--pretrain N`` first trains N steps of the baseline (fp32 AdamW, autocast, hf_clients' schedule
over ``--steps``; the twenty-first session's file was made with a constant LR) so that the weights
are not those of initialization; ``--pretrain 50,150,300``
compares at each of those steps of one run: whether FP8's gradients part further from fp32's than
bf16's do as training goes on (the FP8 loss gap grows over hf_clients' 300 steps).

    python benchmarks/fp8_gradient_check.py --model llama --size full --pretrain 50 \
        --out benchmarks/results/fp8_gradient_check_h200.json
    python benchmarks/fp8_gradient_check.py --model llama --size full --pretrain 50,150,300 \
        --rows fp32,fp32_next_batch,bf16,ours_eager,fastaccum_eager,rowwise_eager \
        --out benchmarks/results/fp8_gradient_trajectory_llama_h200.json
    python benchmarks/fp8_gradient_check.py --model llama --size tiny --device cpu --out /tmp/fp8_gradient_check_cpu.json
"""

import argparse
import copy
import json
import statistics

import torch
from hf_clients import (
    DEFAULTS,
    FP8_EXCLUDE,
    build_model,
    default_lr_warmup,
    fp8_options,
    loss_function,
    lr_factor,
    make_step,
    model_config,
)
from train_gpt import batch, load_corpus, train_starts

import flash_inductor
from flash_inductor.formats.fp8 import sqnr_db

ROWS = ("fp32", "fp32_next_batch", "bf16", "ours_eager", "ours", "fastaccum_eager", "rowwise_eager", "e4m3grads_eager",
        "torchao")
OUR_ROWS = {"ours_eager": dict(compiler="eager"), "ours": {}, "fastaccum_eager": dict(compiler="eager", fp8_fast_accum=True),
            "rowwise_eager": dict(compiler="eager", fp8="rowwise"),
            "e4m3grads_eager": dict(compiler="eager", fp8_e4m3_gradients=True)}


def torchao_model(model, name, device):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module, fqn):
        return (not any(fqn.startswith(e) for e in FP8_EXCLUDE[name]) and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    # off CUDA torchao emulates its GEMMs (the same casts and scales, fp32 matmuls)
    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                                      module_filter_fn=eligible)


def row_model(row, model, x, args):
    """A copy of ``model`` and its loss function as ``row`` computes it."""
    model = copy.deepcopy(model)
    loss_fn = loss_function(model, not row.startswith("fp32"))
    if row in OUR_ROWS:
        loss_fn = flash_inductor.compile(loss_fn, **{**fp8_options(args), **OUR_ROWS[row]})
    elif row == "torchao":
        torchao_model(model, args.model, x.device)
        loss_fn = torch.compile(loss_fn)
    return model, loss_fn


def loss_and_grads(row, model, batches, args, row_models):
    """The loss and ``{name: gradient}`` of ``row`` on a copy of ``model``; the copy and its compiled loss are
    kept in ``row_models`` and take the weights of later checkpoints (no new trace)."""
    if row not in row_models:
        row_models[row] = row_model(row, model, batches[0][0], args)
    copied, loss_fn = row_models[row]
    copied.load_state_dict(model.state_dict())
    copied.zero_grad(set_to_none=True)
    loss = loss_fn(*batches[row == "fp32_next_batch"])
    loss.backward()
    return float(loss.detach()), {n: p.grad.float() for n, p in copied.named_parameters() if p.grad is not None}


def pretrainer(model, corpus, args, device):
    """train(n): the baseline's steps (fp32 AdamW, autocast, clipping, hf_clients' schedule) up to step n."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.lr_warmup, args.steps))
    step_loss = torch.compile(loss_function(model, True)) if device.type == "cuda" else loss_function(model, True)
    step = make_step(step_loss, model.parameters(), opt, clip=1.0)
    starts = train_starts(len(corpus.train), args.steps, args.batch, args.seq, args.seed + 1).to(device)
    done = 0

    def train(n):
        nonlocal done
        for i in range(done, n):
            loss = step(*batch(corpus.train, starts[i], args.seq))
            schedule.step()
            done = i + 1
        print(f"pretrained {n} steps: loss {float(loss):.4f}" if n else "weights at initialization")

    return train


def compare(grads, reference):
    """{name: SQNR dB of ``grads[name]`` against ``reference[name]``}."""
    return {n: float(sqnr_db(reference[n], grads[n])) for n in reference if n in grads}


def compare_rows(model, batches, rows, fp8_params, args, row_models):
    """Every row's loss and gradients on the first of ``batches`` (x, y) (fp32_next_batch: on the
    second), their SQNR against the reference row, printed."""
    losses, grads = {}, {}
    for row in rows:
        losses[row], grads[row] = loss_and_grads(row, model, batches, args, row_models)
    reference = "fp32" if "fp32" in rows else "bf16"
    result = dict(losses=losses, reference=reference, per_parameter={}, summary={})
    pairs = [(row, reference) for row in rows if row != reference]
    if {"ours", "ours_eager"} <= set(rows):
        pairs.append(("ours", "ours_eager"))
    print("loss: " + "  ".join(f"{row} {losses[row]:.5f}" for row in rows))
    print(f"{'row':<26} {'FP8 weights: median dB':>22} {'min dB':>8} {'other params: median dB':>24}  lowest")
    for row, ref in pairs:
        db = compare(grads[row], grads[ref])
        key = f"{row}_vs_{ref}"
        result["per_parameter"][key] = db
        on_fp8 = [db[n] for n in fp8_params if n in db]
        other = [v for n, v in db.items() if n not in fp8_params]
        worst = sorted(db, key=db.get)[:args.worst]
        result["summary"][key] = dict(fp8_median=statistics.median(on_fp8), fp8_min=min(on_fp8),
                                      other_median=statistics.median(other) if other else None,
                                      worst={n: db[n] for n in worst})
        print(f"{key:<26} {statistics.median(on_fp8):22.2f} {min(on_fp8):8.2f} "
              f"{statistics.median(other) if other else float('nan'):24.2f}  "
              + ", ".join(f"{n} {db[n]:.1f}" for n in worst[:3]))
    if {"ours", "torchao"} <= set(rows):
        ours, theirs = result["per_parameter"][f"ours_vs_{reference}"], result["per_parameter"][f"torchao_vs_{reference}"]
        behind = {n: theirs[n] - ours[n] for n in fp8_params if n in ours and theirs[n] - ours[n] > 3}
        result["summary"]["ours_3db_behind_torchao"] = behind
        print(f"FP8 weights whose gradient is more than 3 dB further from {reference} with ours than with torchao: "
              f"{len(behind)}" + "".join(f"\n  {n}: {d:.1f} dB" for n, d in sorted(behind.items(), key=lambda kv: -kv[1])[:10]))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2", "gpt"])
    parser.add_argument("--size", default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain", default="0", help="baseline steps before the comparison; a comma-separated list "
                        "compares after each")
    parser.add_argument("--steps", type=int, default=300, help="the length of the schedule the pretraining follows")
    parser.add_argument("--rows", default="bf16,ours_eager,ours,torchao", help=f"comma-separated, of {ROWS}")
    parser.add_argument("--worst", type=int, default=8, help="parameters listed per row, the lowest SQNR first")
    parser.add_argument("--out", default="fp8_gradient_check.json")
    args = parser.parse_args()
    rows, checkpoints = args.rows.split(","), sorted({int(n) for n in args.pretrain.split(",")})
    unknown = set(rows) - set(ROWS)
    if unknown or not {"fp32", "bf16"} & set(rows) or ("fp32_next_batch" in rows and "fp32" not in rows):
        parser.error(f"--rows: {sorted(unknown)} unknown; the rows need fp32 or bf16 (the reference), "
                     f"fp32_next_batch needs fp32; choose from {ROWS}")
    args.batch, args.seq, args.lr = DEFAULTS[args.model][args.size]
    args.fp8_exclude, args.lr_warmup = (), default_lr_warmup(args.steps)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = build_model(args.model, model_config(args.model, args.size, args.seq)).to(device)
    corpus = load_corpus()
    corpus.train = corpus.train.to(device)
    train = pretrainer(model, corpus, args, device)
    batches = [batch(corpus.train, starts, args.seq)
               for starts in train_starts(len(corpus.train), 2, args.batch, args.seq, args.seed).to(device)]
    fp8_params = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and not any(n.startswith(e) for e in FP8_EXCLUDE[args.model])]
    result = dict(model=args.model, size=args.size, batch=args.batch, seq=args.seq, seed=args.seed, steps=args.steps,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                  after_steps={})
    row_models = {}
    for n in checkpoints:
        train(n)
        result["after_steps"][n] = compare_rows(model, batches, rows, fp8_params, args, row_models)
        with open(args.out, "w") as f:  # each checkpoint's rows kept should a later one not finish
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
