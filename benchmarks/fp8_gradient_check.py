"""Where our FP8 pass and torchao's float8 part on a real model: one step's loss and gradients.

On the H200 the Llama of hf_clients.py trained with our FP8 pass on fp32 masters (``baseline_fp8``)
ended above torchao's float8 on the same setup on both seeds run (+4.00 / +1.26% against +1.86 /
+0.58%; docs/benchmarks.md), while on the CPU's small Llama the two recipes agree. This script
holds one model's weights and one batch fixed and computes the loss and every parameter's gradient
with:

    bf16           bf16 autocast, no FP8, eager: the reference
    ours_eager     our FP8 pass (``fp8="tensorwise"``, hf_clients' exclusions), aten kernels (compiler="eager")
    ours           the same, compiled by Inductor (what hf_clients' rows run)
    torchao        torchao's ``convert_to_float8_training`` (lm_head excluded), ``torch.compile``

and reports each row's gradient SQNR against ``bf16`` per parameter (and ``ours`` against
``ours_eager``): a compiled FP8 layer that computes something else than its eager graph (as
Inductor's amaxes did for FP8-LM's states, sixteenth session) shows as a layer where ``ours`` is
far below ``ours_eager``; a difference of recipe, as one where both are below ``torchao``.
``--pretrain N`` first trains N steps of the baseline (fp32 AdamW, autocast) so that the weights are
not those of initialization.

    python benchmarks/fp8_gradient_check.py --model llama --size full --pretrain 50 \
        --out benchmarks/results/fp8_gradient_check_h200.json
    python benchmarks/fp8_gradient_check.py --model llama --size tiny --device cpu --out /tmp/fp8_gradient_check_cpu.json
"""

import argparse
import copy
import json
import statistics

import torch
from hf_clients import DEFAULTS, FP8_EXCLUDE, build_model, fp8_options, loss_function, model_config
from train_gpt import batch, load_corpus, train_starts

import flash_inductor
from flash_inductor.formats.fp8 import sqnr_db

ROWS = ("bf16", "ours_eager", "ours", "torchao")


def torchao_model(model, name, device):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module, fqn):
        return (not any(fqn.startswith(e) for e in FP8_EXCLUDE[name]) and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    # off CUDA torchao emulates its GEMMs (the same casts and scales, fp32 matmuls)
    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=device.type != "cuda"),
                                      module_filter_fn=eligible)


def loss_and_grads(row, model, x, y, args):
    """The loss and ``{name: gradient}`` of ``row`` on a copy of ``model``."""
    model = copy.deepcopy(model)
    loss_fn = loss_function(model, True)
    if row in ("ours_eager", "ours"):
        loss_fn = flash_inductor.compile(loss_fn, **fp8_options(args), **({"compiler": "eager"} if row == "ours_eager" else {}))
    elif row == "torchao":
        torchao_model(model, args.model, x.device)
        loss_fn = torch.compile(loss_fn)
    loss = loss_fn(x, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def pretrain(model, corpus, args, device):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step_loss = torch.compile(loss_function(model, True)) if device.type == "cuda" else loss_function(model, True)
    starts = train_starts(len(corpus.train), args.pretrain, args.batch, args.seq, args.seed + 1).to(device)
    for i in range(args.pretrain):
        loss = step_loss(*batch(corpus.train, starts[i], args.seq))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    print(f"pretrained {args.pretrain} steps: loss {float(loss.detach()):.4f}" if args.pretrain else "weights at initialization")


def compare(grads, reference):
    """{name: SQNR dB of ``grads[name]`` against ``reference[name]``}."""
    return {n: float(sqnr_db(reference[n], grads[n])) for n in reference if n in grads}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2", "gpt"])
    parser.add_argument("--size", default="full")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain", type=int, default=0, help="baseline steps before the comparison")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--worst", type=int, default=8, help="parameters listed per row, the lowest SQNR first")
    parser.add_argument("--out", default="fp8_gradient_check.json")
    args = parser.parse_args()
    args.batch, args.seq, args.lr = DEFAULTS[args.model][args.size]
    args.fp8_exclude = ()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = build_model(args.model, model_config(args.model, args.size, args.seq)).to(device)
    corpus = load_corpus()
    corpus.train = corpus.train.to(device)
    pretrain(model, corpus, args, device)
    x, y = batch(corpus.train, train_starts(len(corpus.train), 1, args.batch, args.seq, args.seed).to(device)[0], args.seq)
    rows = args.rows.split(",")
    losses, grads = {}, {}
    for row in rows:
        losses[row], grads[row] = loss_and_grads(row, model, x, y, args)
    fp8_params = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and not any(n.startswith(e) for e in FP8_EXCLUDE[args.model])]
    fp8_params = [f"{n}.weight" for n in fp8_params]
    result = dict(model=args.model, size=args.size, batch=args.batch, seq=args.seq, seed=args.seed, pretrain=args.pretrain,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                  losses=losses, per_parameter={}, summary={})
    pairs = [(row, "bf16") for row in rows if row != "bf16"]
    if {"ours", "ours_eager"} <= set(rows):
        pairs.append(("ours", "ours_eager"))
    print("loss: " + "  ".join(f"{row} {losses[row]:.5f}" for row in rows))
    print(f"{'row':<22} {'FP8 weights: median dB':>22} {'min dB':>8} {'other params: median dB':>24}  lowest")
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
        print(f"{key:<22} {statistics.median(on_fp8):22.2f} {min(on_fp8):8.2f} "
              f"{statistics.median(other) if other else float('nan'):24.2f}  "
              + ", ".join(f"{n} {db[n]:.1f}" for n in worst[:3]))
    if {"ours", "torchao"} <= set(rows):
        ours, theirs = result["per_parameter"]["ours_vs_bf16"], result["per_parameter"]["torchao_vs_bf16"]
        behind = {n: theirs[n] - ours[n] for n in fp8_params if n in ours and theirs[n] - ours[n] > 3}
        result["summary"]["ours_3db_behind_torchao"] = behind
        print(f"FP8 weights whose gradient is more than 3 dB further from bf16 with ours than with torchao: {len(behind)}"
              + "".join(f"\n  {n}: {d:.1f} dB" for n, d in sorted(behind.items(), key=lambda kv: -kv[1])[:10]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
