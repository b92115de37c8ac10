"""Which part of the 8-bit Adam states strays from fp32 Adam, on a real model's own gradients (issue 14).

Over six seeds of the Hugging Face Llama (300 steps), the companded 8-bit states end +2.10% above
the baseline's loss, fp32 states -0.14% and FP8-LM's states -0.05% (docs/benchmarks.md). This script
looks for the cause on the gradients of one real run: it trains the baseline (fp32 masters, torch's
fused AdamW, bf16 autocast, compiled model) and keeps, beside it, Adam's two moments of every
parameter the package would quantize (``min_quantized_numel`` elements or more) in each candidate
format, fed the same clipped gradients every step ("shadow states"). A shadow stores its moments
rounded, as the real step stores them, so roundings accumulate as they do in training; what it
leaves out is their effect on the weights (the trajectory is the baseline's). At log steps it
compares each candidate's update ``m^ / (sqrt(v^) + eps)`` with the exact one (fp32 moments fed the
same gradients), per kind of parameter:

    relerr    ||u - u_exact|| / ||u_exact||
    bias      sum |u| / sum |u_exact|        (below 1: updates damped on the whole)
    damped    elements with |u| < |u_exact| / 2
    inflated  elements with |u| > 2 |u_exact|

Candidates: ``state_candidates.CANDIDATES`` (the package's formats, each companded moment alone,
and formats the package does not have).

    python benchmarks/state_fidelity.py --model llama --steps 300 --out benchmarks/results/state_fidelity_llama_h200.json
    python benchmarks/state_fidelity.py --model llama --size tiny --device cpu --steps 20      # a quick check
"""

import argparse
import math
import pathlib
import sys
import time

import torch

from flash_inductor.formats import companded

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hf_clients  # noqa: E402
from state_candidates import CANDIDATES, store_by_tensor  # noqa: E402
from train_gpt import batch, load_corpus, timed_step, train_starts, write_json  # noqa: E402

GROUP = companded.GROUP_SIZE
MIN_QUANTIZED_NUMEL = 4096  # prepare's default: smaller tensors keep fp32 states
KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
         "wte", "c_attn", "c_proj", "c_fc")


def kind_of(name):
    return next((k for k in KINDS if k in name.split(".")), "other")


# --------------------------------------------------------------------------------- the shadows


class Shadows:
    """Adam's moments of ``params`` (each a run of whole rows of 32) in fp32 and in each candidate format."""

    def __init__(self, named_params, candidates, betas, eps):
        self.params = [(n, p) for n, p in named_params if p.numel() >= MIN_QUANTIZED_NUMEL]
        rows = [-(-p.numel() // GROUP) for _, p in self.params]
        self.starts = torch.tensor([0] + rows[:-1]).cumsum(0).tolist()
        self.ends = [a + n for a, n in zip(self.starts, rows)]
        self.rows = sum(rows)
        self.kinds = [kind_of(n) for n, _ in self.params]
        self.betas, self.eps, self.t = betas, eps, 0
        zeros = lambda: torch.zeros(self.rows, GROUP, device=self.params[0][1].device)  # noqa: E731
        self.candidates = {name: CANDIDATES[name] for name in candidates}
        self.moments = {name: [zeros(), zeros()] for name in ("exact", *self.candidates)}

    def gradient_rows(self):
        flat = torch.zeros(self.rows * GROUP, device=self.params[0][1].device)
        for (_, p), start in zip(self.params, self.starts):
            flat[start * GROUP:start * GROUP + p.numel()] = p.grad.reshape(-1).float()
        return flat.view(self.rows, GROUP)

    @torch.no_grad()
    def step(self, measure):
        """One Adam step of every shadow on the parameters' current gradients; with ``measure``, each
        candidate's update against the exact one, by kind of parameter."""
        self.t += 1
        (b1, b2), t = self.betas, self.t
        g = self.gradient_rows()
        updates, stats = {}, {}
        for name in self.moments:
            m, v = self.moments[name]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if measure:
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + self.eps)
                if name == "exact":
                    updates[name] = update
                else:
                    stats[name] = self.compare(update, updates["exact"])
                    del update
            if name != "exact":
                for store, moment in zip(self.candidates[name], (m, v)):
                    store_by_tensor(store, moment, self.starts, self.ends)
        return stats

    def compare(self, update, reference):
        """Per kind and over all: relerr, bias, damped and inflated fractions (``module docstring``)."""
        sums = {}
        for (_, p), kind, start in zip(self.params, self.kinds, self.starts):
            u = update.view(-1)[start * GROUP:start * GROUP + p.numel()]
            r = reference.view(-1)[start * GROUP:start * GROUP + p.numel()]
            a, b = u.abs(), r.abs()
            values = torch.stack([((u - r) ** 2).sum(), (r ** 2).sum(), a.sum(), b.sum(),
                                  (a < b / 2).sum(), (a > 2 * b).sum(), torch.tensor(p.numel(), device=u.device)])
            for key in (kind, "all"):
                sums[key] = sums.get(key, 0) + values.double()
        return {kind: dict(relerr=math.sqrt(s[0] / s[1]), bias=s[2] / s[3], damped=s[4] / s[6], inflated=s[5] / s[6],
                           numel=int(s[6]))
                for kind, s in ((k, s.tolist()) for k, s in sums.items())}


# ------------------------------------------------------------------------------------------ run


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--size", choices=("full", "small", "tiny"), default="full")
    parser.add_argument("--attention", choices=("mask", "is_causal"), default="mask")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--measure-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma list of {', '.join(CANDIDATES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="state_fidelity.json")
    argv = list(argv or [])
    args = parser.parse_args(argv)
    for name in args.candidates.split(","):
        if name not in CANDIDATES:
            parser.error(f"unknown candidate {name!r}; choose from {list(CANDIDATES)}")
    # the model, batch, LR schedule and clipping of hf_clients.py's rows
    client = hf_clients.parse_args(["--model", args.model, "--size", args.size, "--attention", args.attention,
                                    "--steps", str(args.steps), "--seed", str(args.seed), "--device", args.device,
                                    "--configs", "baseline"])
    return args, client


def main(argv=None):
    args, client = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    corpus = load_corpus()
    corpus.train = corpus.train.to(device)
    setup, clip, schedule = hf_clients.build("baseline", client, device)
    group = setup.optimizer.param_groups[0]
    shadows = Shadows(setup.model.named_parameters(), args.candidates.split(","), group["betas"], group["eps"])
    measured = {}
    measure_at = {1, *range(args.measure_every, args.steps + 1, args.measure_every)}

    def shadow_step(optimizer, args_, kwargs):
        # the baseline's step clips, then calls its optimizer: the shadows step on the same clipped gradients
        stats = shadows.step(measure=shadows.t + 1 in measure_at)
        if stats:
            measured[shadows.t] = stats

    setup.optimizer.register_step_pre_hook(shadow_step)
    starts = train_starts(len(corpus.train), args.steps, client.batch, client.seq, args.seed).to(device)
    losses, t0 = [], time.perf_counter()
    for i in range(args.steps):
        x, y = batch(corpus.train, starts[i], client.seq)
        loss, _, _ = timed_step(setup, x, y, device, first=i == 0)
        losses.append(loss)
        schedule.step()
        if i + 1 in measure_at:
            print_step(i + 1, loss, measured[i + 1], time.perf_counter() - t0)
    results = dict(info=dict(model=args.model, size=args.size, steps=args.steps, seed=args.seed, clip=clip,
                             betas=list(group["betas"]), eps=group["eps"], shadowed_params=len(shadows.params),
                             shadowed_numel=sum(p.numel() for _, p in shadows.params), torch=torch.__version__,
                             device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                   train_loss=losses, measured={str(k): v for k, v in measured.items()})
    print_summary(measured)
    write_json(results, args.out)
    print(f"wrote {args.out}")
    return results


def print_step(step, loss, stats, seconds):
    print(f"step {step:4d}  loss {loss:.4f}  ({seconds:.0f} s)")
    for name, by_kind in stats.items():
        a = by_kind["all"]
        print(f"  {name:18s} relerr {a['relerr']:.4f}  bias {a['bias']:.4f}  damped {a['damped']:.2e}  "
              f"inflated {a['inflated']:.2e}", flush=True)


def print_summary(measured):
    """Each candidate's figures over the measured steps after the first (mean), overall and by kind."""
    steps = [s for s in sorted(measured) if s > 1]
    if not steps:
        return
    names = list(measured[steps[0]])
    kinds = list(measured[steps[0]][names[0]])
    print(f"\nmean over steps {steps[0]}..{steps[-1]}: relerr / bias")
    print(f"{'candidate':18s} " + " ".join(f"{k:>16s}" for k in kinds))
    for name in names:
        cells = []
        for kind in kinds:
            r = sum(measured[s][name][kind]["relerr"] for s in steps) / len(steps)
            b = sum(measured[s][name][kind]["bias"] for s in steps) / len(steps)
            cells.append(f"{r:7.4f} / {b:6.4f}")
        print(f"{name:18s} " + " ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
