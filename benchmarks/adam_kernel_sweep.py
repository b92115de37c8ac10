"""Launch shapes of the hand-written AdamW kernel (flash_inductor/triton_adam.py), timed in one run (GPU).

Each parameter list (optimizer_step.py's PARAM_LISTS, prepared as its ``flashoptim`` config) is
built once and stepped once. Then for each ``triton_adam.LaunchShape`` of the grid: the stored state is
set back to the state saved after that step, one step runs with the shape (compiling it) and its stored bytes
(weights, error terms, state codes and scales, step counts) are compared with those of one step of
the default shape from the same state: a launch shape must not change a bit. A shape whose bytes may
differ (the other arithmetic than the default's: with or without ``approx``) is held to the fp64
reference step instead, with the tests'
tolerances (tests/test_optimizer_numerics.py: states within one code, masters within one error-code
step), and its row counts the stored values that differ from the default's step. Then
``opt.step()`` is timed (median, optimizer_step.time_ms) and the kernel's own time read from the
profiler. One row per shape and list: ms, GB/s and % of the copy-bandwidth floor at 12.25 B/param
(optimizer_step.py's bytes), identical yes/no (or the reference check); the JSON (--out) is written
after every row, so a run cut short keeps what it measured. A shape that fails to compile or run
prints its error and the sweep goes on.

    python benchmarks/adam_kernel_sweep.py --lists 64x2048x2048,gpt2_124m --out adam_kernel_sweep.json
    python benchmarks/adam_kernel_sweep.py --shapes block64_warps4,block64_warps4_approx,block32_warps2_approx
"""

import argparse
import collections
import dataclasses
import json
import pathlib
import sys
import time

import torch
from gpu_profile import kernel_times
from optimizer_step import BYTES_PER_PARAM, PARAM_LISTS, gpt_1b_shapes, measure_copy_bandwidth, prepared_flashoptim, time_ms

from flash_inductor import roles, triton_adam
from flash_inductor.triton_adam import LaunchShape

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers import bits  # noqa: E402
from test_optimizer_numerics import compare_with_expected_steps, expected_steps  # noqa: E402

# Around the default (64 groups, 4 warps) and around block32_warps2, one or two knobs at a time; the
# elements per thread are block / warps (16 for both): 8 halves the registers (sm_90 compiles: ~64
# against ~120, twice the warps per SM), 32 doubles them.
DEFAULT_GRID = [
    "block64_warps4", "block64_warps4_vector8", "block64_warps4_vector16", "block64_warps4_evict",
    "block64_warps4_vector8_evict", "block64_warps4_persist4", "block64_warps4_vector8_evict_persist2_stages3",
    "block32_warps2", "block32_warps2_vector8", "block32_warps2_vector8_evict", "block32_warps2_vector8_persist4_stages2",
    "block32_warps2_vector8_persist8_stages2",
    "block16_warps2", "block16_warps2_vector8", "block32_warps4_vector8", "block64_warps8_vector8",
    "block32_warps4_vector8_evict", "block32_warps4_vector8_persist8", "block32_warps4_vector8_persist8_stages2",
    "block32_warps4_vector8_persist4_stages3", "block32_warps4_vector8_evict_persist8_stages2",
    "block16_warps2_vector8_persist16_stages2", "block16_warps4_vector4", "block16_warps1_vector8",
    "block128_warps8_vector8", "block64_warps2_vector8",
]


class PreparedList:
    """A parameter list prepared once, its stored state after one default step (so that the steps compared
    decode nonzero states) and the bytes of one more default step from it."""

    def __init__(self, name):
        shapes = PARAM_LISTS[name] or gpt_1b_shapes()
        self.name, self.num_params = name, sum(torch.Size(s).numel() for s in shapes)
        self.model, self.opt = prepared_flashoptim(shapes, False, {})
        triton_adam.LAUNCH = LaunchShape()
        self.opt.step()
        self.initial = [t.clone() for _, t in self.stored()]
        self.step_from_initial(LaunchShape())
        self.expected = [t.clone() for _, t in self.stored()]

    def stored(self):
        """(kind, tensor) of every tensor a step writes: weights, error terms, step counts, each state's
        codes and scales."""
        tensors = []
        for b in roles.PREPARED[self.opt].buckets:
            tensors += [("weights", b.weights), ("errors", b.errors), ("step", b.step)]
            tensors += [(f"{name}.{k}", getattr(s, k)) for name, s in b.states.items() for k in s._inner]
        return [(kind, t) for kind, t in tensors if t is not None]

    def step_from_initial(self, shape):
        triton_adam.LAUNCH = shape
        for (_, t), saved in zip(self.stored(), self.initial):
            t.copy_(saved)
        self.opt.step()

    def measure(self, shape, bandwidth):
        if shape.same_bytes_as_default:
            t0 = time.perf_counter()
            self.step_from_initial(shape)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            check = dict(identical=all(torch.equal(bits(t), bits(e)) for (_, t), e in zip(self.stored(), self.expected)))
        else:
            first_s, check = self.check_against_reference(shape)
        ms = time_ms(self.opt.step, warmup=25, rep=150)
        kernel_ms = sum(us for name, _, us in kernel_times(self.opt.step, top=100) if "_adam_kernel" in name) / 1e3
        floor_ms = self.num_params * BYTES_PER_PARAM["flashoptim"] / bandwidth * 1e3
        return dict(ms=ms, kernel_ms=kernel_ms, GBps=self.num_params * BYTES_PER_PARAM["flashoptim"] / ms / 1e6,
                    floor_pct=100 * floor_ms / ms, first_step_s=first_s, **check)

    def check_against_reference(self, shape):
        """One step of ``shape`` from the saved state against the fp64 reference step (every parameter with
        8-bit states): (the step's seconds, {reference: "ok" or the first miss, the reference check's
        counts, differs: {kind: [values differing from the default's step, values]}})."""
        triton_adam.LAUNCH = shape
        for (_, t), saved in zip(self.stored(), self.initial):
            t.copy_(saved)
        expected = expected_steps(self.model, self.opt, "adamw")
        t0 = time.perf_counter()
        self.opt.step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        try:
            counts, reference = compare_with_expected_steps(self.model, self.opt, expected, shape.name), "ok"
        except AssertionError as e:
            counts, reference = collections.Counter(), str(e)[:300]
        del expected
        differs = collections.defaultdict(lambda: [0, 0])
        for (kind, t), e in zip(self.stored(), self.expected):
            differs[kind][0] += int((bits(t) != bits(e)).sum())
            differs[kind][1] += t.numel()
        return first_s, dict(reference=reference, **counts, differs=dict(differs))


def row_text(row):
    if "error" in row:
        return f"{row['list']:14s} {row['shape']:48s} FAILED {row['error']}"
    text = (f"{row['list']:14s} {row['shape']:48s} {row['ms']:7.3f} ms  kernel {row['kernel_ms']:7.3f} ms  "
            f"{row['GBps']:6.0f} GB/s  {row['floor_pct']:5.1f}% of floor  ")
    if "identical" in row:
        text += f"identical {'yes' if row['identical'] else 'NO'}"
    else:  # held to the fp64 reference; how much differs from the default's step
        text += f"fp64 reference {row['reference']}"
        if row["reference"] == "ok":
            text += (f" (codes one off {row.get('codes_off', 0)} of {row['codes']}, masters past one code step "
                     f"{row.get('masters_off', 0)} of {row['masters']})")
        text += "; differ from the default's: " + ", ".join(
            f"{kind} {100 * n / total:.3g}%" for kind, (n, total) in row["differs"].items() if kind != "step")
    return text + f"  (first step {row['first_step_s']:.1f} s)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lists", default="64x2048x2048,gpt2_124m", help=f"comma list of {', '.join(PARAM_LISTS)}")
    parser.add_argument("--shapes", default=",".join(DEFAULT_GRID),
                        help="comma list of launch shapes block{B}_warps{W}[_vector{V}][_evict][_persist{K}][_stages{S}][_approx] "
                             "(triton_adam.LaunchShape.from_name; default: a grid of %d)" % len(DEFAULT_GRID))
    parser.add_argument("--out", default="adam_kernel_sweep.json")
    parser.add_argument("--time-limit", type=float, default=170.0,
                        help="seconds from the start after which no new shape is started (the summary still prints)")
    parser.add_argument("--fastest", metavar="JSON",
                        help="print the optimizer_step.py config of the fastest shape of --list in a sweep's JSON that stored "
                             "the default's bytes or met the fp64 reference, and exit (the default shape's when none beats it)")
    parser.add_argument("--list", default="64x2048x2048", help="the list --fastest reads")
    args = parser.parse_args()
    if args.fastest:
        print(f"flashoptim_{fastest_shape(args.fastest, args.list)}")
        return
    start = time.perf_counter()
    try:
        shapes = [LaunchShape.from_name(name) for name in args.shapes.split(",")]
    except ValueError as e:
        parser.error(str(e))
    bandwidth = measure_copy_bandwidth()
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), copy_bandwidth_GBps=bandwidth / 1e9,
                bytes_per_param=BYTES_PER_PARAM["flashoptim"], date=time.strftime("%Y-%m-%d"))
    lists = [PreparedList(name) for name in args.lists.split(",")]
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; lists prepared after {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for shape in shapes:  # shapes outside, lists inside: a run cut short has every list for the shapes it did
        if time.perf_counter() - start > args.time_limit:
            print(f"time limit: {len(shapes) - shapes.index(shape)} shapes not run", flush=True)
            break
        for prepared in lists:
            row = dict(list=prepared.name, shape=shape.name, launch=dataclasses.asdict(shape))
            try:
                row.update(prepared.measure(shape, bandwidth))
            except Exception as e:  # a shape Triton cannot compile, or that runs out of resources
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row_text(row), flush=True)
            with open(args.out, "w") as f:
                json.dump({"info": info, "rows": rows}, f, indent=1)
    triton_adam.LAUNCH = LaunchShape()
    for prepared in lists:
        done = sorted((r for r in rows if r["list"] == prepared.name and "error" not in r), key=lambda r: r["ms"])
        print(f"\nfastest on {prepared.name}:")
        for row in done[:5]:
            print(row_text(row))
    print(f"\n{time.perf_counter() - start:.0f} s; wrote {args.out}")


def fastest_shape(path, list_name):
    """The name of the fastest shape of ``list_name`` in a sweep's JSON that stored the default's bytes
    or (``approx``) met the fp64 reference."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["list"] == list_name and "error" not in r
                and (r.get("identical") or r.get("reference") == "ok")]
    return min(rows, key=lambda r: r["ms"])["shape"] if rows else LaunchShape().name


if __name__ == "__main__":
    main()
