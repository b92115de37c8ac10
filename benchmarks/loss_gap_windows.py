"""The loss gap of each configuration against the baseline, window by window over the run, from the
curves that ``hf_clients.py`` stores (a merged seeds file): for each window, each seed's mean loss
against the baseline's of the same seed, then the mean and standard deviation over the seeds.

    python benchmarks/loss_gap_windows.py benchmarks/results/hf_clients_llama_seeds_all_nearest_h200.json \\
        --configs flashoptim_fp8+fastaccum,flashoptim,torchao_float8 --windows 0,30,60,100,150,200,250,300

Then the last-50 gaps: each configuration's mean with its 95% interval, median and standard
deviation over its seeds, and for each ``--pairs A:B`` the difference A's gap minus B's, seed by seed
over the seeds both ran: two rows that ran the same seeds share each seed's baseline run, whose own
spread the difference cancels. ``--seeds 0-14`` (or ``0,3,5``) keeps only those seeds, in both tables.
"""

import argparse
import collections
import json
import statistics
import sys

from hf_clients import mean_interval, parse_run_key


def by_config(runs, field, seeds=None):
    """{configuration: {seed: run[field]}}, of ``seeds`` only where given."""
    values = collections.defaultdict(dict)
    for key, run in runs.items():
        name, seed = parse_run_key(key)
        if seeds is None or seed in seeds:
            values[name][seed] = run[field]
    return values


def gap_windows(runs, config, bounds, baseline="baseline", seeds=None):
    """[(mean %, standard deviation %)] per window ``bounds[i]..bounds[i + 1]`` over the seeds that
    both ``config`` and ``baseline`` ran (of ``seeds``), and that number of seeds."""
    curves = by_config(runs, "train_loss", seeds)
    seeds = sorted(set(curves[config]) & set(curves[baseline]))
    gaps = []
    for a, b in zip(bounds, bounds[1:]):
        per_seed = [100 * (sum(curves[config][s][a:b]) / sum(curves[baseline][s][a:b]) - 1) for s in seeds]
        gaps.append((statistics.mean(per_seed), statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0))
    return gaps, len(seeds)


def last50_gaps(runs, config, baseline="baseline", seeds=None):
    """{seed: ``config``'s last-50 loss over ``baseline``'s of the same seed, minus 1, in %}."""
    losses = by_config(runs, "last50_loss", seeds)
    return {s: 100 * (loss / losses[baseline][s] - 1) for s, loss in losses[config].items() if s in losses[baseline]}


def describe(values):
    """(seeds, mean, 95% interval low, high, median, standard deviation) of ``{seed: value}``; None
    under two seeds, which have no spread."""
    v = [values[s] for s in sorted(values)]
    return (len(v), *mean_interval(v), statistics.median(v), statistics.stdev(v)) if len(v) >= 2 else None


def paired_difference(runs, first, second, seeds=None):
    """``first``'s last-50 gap minus ``second``'s (points), seed by seed over the seeds both ran:
    ``describe``'s tuple."""
    a, b = last50_gaps(runs, first, seeds=seeds), last50_gaps(runs, second, seeds=seeds)
    return describe({s: a[s] - b[s] for s in a if s in b})


def parse_seeds(text):
    """``"0-14"`` or ``"0,3,5"`` (or both: ``"0-4,9"``) as a set of ints."""
    seeds = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.update(range(int(low), int(high or low) + 1))
    return seeds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--configs", required=True)
    parser.add_argument("--windows", default="0,30,60,100,150,200,250,300")
    parser.add_argument("--pairs", default="", help="A:B,C:D: the seed-by-seed difference of A's last-50 gap and B's")
    parser.add_argument("--seeds", help="only these seeds: 0-14, 0,3,5")
    args = parser.parse_args(argv)
    runs = json.load(open(args.results))["runs"]
    seeds = parse_seeds(args.seeds) if args.seeds else None
    bounds = [int(b) for b in args.windows.split(",")]
    configs = args.configs.split(",")
    print("| steps | " + " | ".join(f"{a}-{b}" for a, b in zip(bounds, bounds[1:])) + " |")
    print("|---" * len(bounds) + "|")
    for config in configs:
        gaps, n = gap_windows(runs, config, bounds, seeds=seeds)
        print(f"| {config} ({n} seeds) | " + " | ".join(f"{m:+.2f}% ({sd:.1f})" for m, sd in gaps) + " |")
    rows = [(config, describe(last50_gaps(runs, config, seeds=seeds))) for config in configs]
    rows += [(f"{a} − {b}, seed by seed (points)", paired_difference(runs, a, b, seeds))
             for a, b in (pair.split(":") for pair in args.pairs.split(",") if pair)]
    print()
    print("| last-50 gap | seeds | mean [95% interval] | median | std |")
    print("|---|---|---|---|---|")
    for name, row in rows:
        if row is None:
            print(f"| {name} | under 2 | | | |")
            continue
        n, mean, low, high, median, sd = row
        print(f"| {name} | {n} | {mean:+.2f} [{low:+.2f}, {high:+.2f}] | {median:+.2f} | {sd:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
