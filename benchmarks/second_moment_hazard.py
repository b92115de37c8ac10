"""The 8-bit second moment's small-value hazard (issue 15, item 4), simulated on the CPU.

Adam's second moment is stored as linear codes of sqrt(v) per group of 32 (DESIGN §2.2), so a
group keeps a 510:1 range of sqrt(v). Under the paper's rule, ``q = round(255 u)``, an element whose
sqrt(v) is below 1/510 of its group's largest decodes to v = 0, while its softsign-coded first
moment (which keeps more small values) need not decode to 0: the next step divides m by
sqrt((1 - beta2) g**2), this step's gradient alone.

This script runs Adam for ``--steps`` steps on Gaussian gradients whose per-element scale is
log-normal (spread sigma) within each group, once in fp64 (the reference) and once with the states
stored the way each rule stores them, and compares the normalized updates ``m^ / (sqrt(v^) + eps)``
element by element:

    paper        q = round(255 u): FlashOptim and DESIGN §2.2 as written
    package      flash_inductor's encode: the paper's code, but at least 1 where u > 0
    m_guard      the paper's code for v, and m stored as 0 wherever v's code is 0
    fourth_root  q = round(255 sqrt(u)), v = ((q / 255)**2 scale)**2: linear in v**(1/4)
                 (a different format: decode changes too)

``package`` is the package's own encode/decode; the others are derived here from the package's fp16
scales (``u = sqrt(v) / scale``, as the package computes it) to compare against.

Columns: largest |update| (quantized; fp64), element-steps whose quantized update exceeds 5x the
fp64 one (all, and those also above 1 in absolute value, i.e. beyond anything fp64 gives), element-steps
damped below 1/5 of fp64, and mean |update| relative to fp64's (the bias of the rule).

    python benchmarks/second_moment_hazard.py                     # beta2 0.999 (torch's default) and 0.95
    python benchmarks/second_moment_hazard.py --out benchmarks/results/second_moment_hazard_cpu.json
"""

import argparse
import json

import torch

from flash_inductor.formats import companded

GROUP = companded.GROUP_SIZE


def _u(v, scales):
    """``sqrt(v) / scale`` per element (0 where the scale is 0 or nan), as the package's encode computes it."""
    s = v.clamp(min=0).sqrt().view(-1, GROUP)
    scale = scales.float().view(-1, 1)
    return torch.where(scale > 0, s * (1 / scale), torch.zeros_like(s))


def _signed_round_trip(m):
    codes, scales = companded.encode(m, companded.SIGNED)
    return companded.decode(codes, scales, m.shape, companded.SIGNED)


def _paper_codes(v):
    _, scales = companded.encode(v, companded.SQRT)
    codes = torch.floor(255 * _u(v, scales) + 0.5).clamp(0, 255).to(torch.uint8)
    return codes, scales


def store_package(m, v):
    codes, scales = companded.encode(v, companded.SQRT)
    return _signed_round_trip(m), companded.decode(codes, scales, v.shape, companded.SQRT)


def store_paper(m, v):
    codes, scales = _paper_codes(v)
    return _signed_round_trip(m), companded.decode(codes, scales, v.shape, companded.SQRT)


def store_m_guard(m, v):
    codes, scales = _paper_codes(v)
    m_stored = torch.where(codes.view(v.shape) == 0, torch.zeros_like(m), _signed_round_trip(m))
    return m_stored, companded.decode(codes, scales, v.shape, companded.SQRT)


def store_fourth_root(m, v):
    _, scales = companded.encode(v, companded.SQRT)
    q = torch.floor(255 * _u(v, scales).sqrt() + 0.5).clamp(0, 255)
    v_stored = ((q / 255) ** 2 * scales.float().view(-1, 1)) ** 2
    return _signed_round_trip(m), v_stored.view(v.shape)


RULES = {"paper": store_paper, "package": store_package, "m_guard": store_m_guard, "fourth_root": store_fourth_root}


def simulate(store, sigma, beta2, groups=1024, steps=200, beta1=0.9, eps=1e-8, seed=0):
    """Adam on ``groups * 32`` elements for ``steps`` steps: the quantized run's normalized updates
    against fp64's. ``store(m, v) -> (m, v)`` as decoded after storing (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * GROUP
    scale = torch.exp(sigma * torch.randn(n, generator=gen, dtype=torch.float64))
    m64, v64 = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    m, v = torch.zeros(n), torch.zeros(n)
    stats = dict(max_quantized=0.0, max_fp64=0.0, over_5x=0, over_5x_above_1=0, damped_5x=0, sum_quantized=0.0,
                 sum_fp64=0.0)
    for t in range(1, steps + 1):
        g = scale * torch.randn(n, generator=gen, dtype=torch.float64)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        m64 = beta1 * m64 + (1 - beta1) * g
        v64 = beta2 * v64 + (1 - beta2) * g * g
        ref = ((m64 / bc1) / ((v64 / bc2).sqrt() + eps)).abs()
        g32 = g.float()  # the step in fp32 from the decoded states, as the compiled step runs it
        m = beta1 * m + (1 - beta1) * g32
        v = beta2 * v + (1 - beta2) * g32 * g32
        got = ((m / bc1) / ((v / bc2).sqrt() + eps)).abs().double()
        stats["max_quantized"] = max(stats["max_quantized"], got.max().item())
        stats["max_fp64"] = max(stats["max_fp64"], ref.max().item())
        over = got > 5 * ref
        stats["over_5x"] += int(over.sum())
        stats["over_5x_above_1"] += int((over & (got > 1)).sum())
        stats["damped_5x"] += int((got < ref / 5).sum())
        stats["sum_quantized"] += got.sum().item()
        stats["sum_fp64"] += ref.sum().item()
        m, v = store(m, v)
    element_steps = n * steps
    return dict(sigma=sigma, beta2=beta2, max_quantized=stats["max_quantized"], max_fp64=stats["max_fp64"],
                over_5x=stats["over_5x"] / element_steps, over_5x_above_1=stats["over_5x_above_1"] / element_steps,
                damped_5x=stats["damped_5x"] / element_steps, mean_ratio=stats["sum_quantized"] / stats["sum_fp64"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    parser.add_argument("--beta2", type=float, nargs="+", default=[0.999, 0.95])
    parser.add_argument("--rules", nargs="+", choices=sorted(RULES), default=list(RULES))
    parser.add_argument("--groups", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # 32k-element ops: threads cost more than they give (and on a shared machine much more)
    rows = []
    print(f"Adam (beta1 0.9, eps 1e-8), {args.groups} groups of 32, {args.steps} steps, seed {args.seed}")
    print(f"{'beta2':>6} {'sigma':>5} {'rule':>12} {'max |upd|':>10} {'fp64 max':>9} {'>5x fp64':>10} "
          f"{'>5x and >1':>10} {'<fp64/5':>9} {'mean/fp64':>9}")
    for beta2 in args.beta2:
        for sigma in args.sigmas:
            for rule in args.rules:
                row = dict(rule=rule, **simulate(RULES[rule], sigma, beta2, args.groups, args.steps, seed=args.seed))
                rows.append(row)
                print(f"{beta2:>6} {sigma:>5} {rule:>12} {row['max_quantized']:>10.3g} {row['max_fp64']:>9.3g} "
                      f"{row['over_5x']:>10.2e} {row['over_5x_above_1']:>10.2e} {row['damped_5x']:>9.2e} "
                      f"{row['mean_ratio']:>9.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(groups=args.groups, steps=args.steps, seed=args.seed, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
