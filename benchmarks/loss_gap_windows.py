"""The loss gap of each configuration against the baseline, window by window over the run, from the
curves that ``hf_clients.py`` stores (a merged seeds file): for each window, each seed's mean loss
against the baseline's of the same seed, then the mean and standard deviation over the seeds.

    python benchmarks/loss_gap_windows.py benchmarks/results/hf_clients_llama_seeds_all_nearest_h200.json \\
        --configs flashoptim_fp8+fastaccum,flashoptim,torchao_float8 --windows 0,30,60,100,150,200,250,300
"""

import argparse
import collections
import json
import statistics
import sys

from hf_clients import parse_run_key


def gap_windows(runs, config, bounds, baseline="baseline"):
    """[(mean %, standard deviation %)] per window ``bounds[i]..bounds[i + 1]`` over the seeds that
    both ``config`` and ``baseline`` ran, and that number of seeds."""
    curves = collections.defaultdict(dict)
    for key, run in runs.items():
        name, seed = parse_run_key(key)
        curves[name][seed] = run["train_loss"]
    seeds = sorted(set(curves[config]) & set(curves[baseline]))
    gaps = []
    for a, b in zip(bounds, bounds[1:]):
        per_seed = [100 * (sum(curves[config][s][a:b]) / sum(curves[baseline][s][a:b]) - 1) for s in seeds]
        gaps.append((statistics.mean(per_seed), statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0))
    return gaps, len(seeds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--configs", required=True)
    parser.add_argument("--windows", default="0,30,60,100,150,200,250,300")
    args = parser.parse_args(argv)
    runs = json.load(open(args.results))["runs"]
    bounds = [int(b) for b in args.windows.split(",")]
    print("| steps | " + " | ".join(f"{a}-{b}" for a, b in zip(bounds, bounds[1:])) + " |")
    print("|---" * len(bounds) + "|")
    for config in args.configs.split(","):
        gaps, seeds = gap_windows(runs, config, bounds)
        print(f"| {config} ({seeds} seeds) | " + " | ".join(f"{m:+.2f}% ({sd:.1f})" for m, sd in gaps) + " |")


if __name__ == "__main__":
    sys.exit(main())
