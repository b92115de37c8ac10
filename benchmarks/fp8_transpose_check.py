"""Where ``fp8_transpose.transpose_fp8``'s CUDA kernel and the CPU copy disagree, element by element.

For each shape, source dtype and scale (none, one a row, one a column) it counts the bytes that
differ from the CPU's ``cast_to_fp8`` + transposed copy and from torch's CUDA cast, and prints the
first few: position, source value, scale, and both results. Run on a GPU:
``python benchmarks/fp8_transpose_check.py --out results.json``.
"""

import argparse
import json

import torch

from flash_inductor import fp8_transpose
from flash_inductor.formats import fp8

SHAPES = [(64, 64), (130, 7), (128, 2048), (8192, 64), (1024, 1024), (8192, 2048), (2048, 8192)]


def _mismatches(shape, source_dtype, by, seed=0):
    torch.manual_seed(seed)
    t = (torch.randn(shape) * 100).to(source_dtype)
    scale = None
    if by != "none":
        scale = 2.0 ** -torch.randint(0, 12, (shape[0], 1) if by == "rows" else (1, shape[1])).to(torch.float32)
    dtype = None if scale is None else torch.float8_e4m3fn  # (a plain copy keeps t's dtype)
    expected = fp8_transpose.transpose_fp8(t, scale, dtype)
    got = fp8_transpose.transpose_fp8(t.cuda(), None if scale is None else scale.cuda(), dtype).cpu()
    source = t.cuda() if scale is None else fp8.cast_to_fp8(t.cuda(), scale.cuda(), dtype)
    torch_cuda = source.t().contiguous().cpu()
    bad = (got.view(torch.uint8) != expected.view(torch.uint8)).nonzero().tolist()
    row = dict(shape=list(shape), source=str(source_dtype), by=by, differ_from_cpu=len(bad),
               differ_from_torch_cuda=int((got.view(torch.uint8) != torch_cuda.view(torch.uint8)).sum()),
               cpu_vs_torch_cuda=int((expected.view(torch.uint8) != torch_cuda.view(torch.uint8)).sum()), first=[])
    for c, r in bad[:6]:  # (position in the copy: column c of t, row r)
        s = 1.0 if scale is None else float(scale.reshape(-1)[r if by == "rows" else c])
        row["first"].append(dict(row=r, col=c, source=float(t[r, c].float()), scale=s,
                                 got=int(got.view(torch.uint8)[c, r]), got_value=float(got[c, r].float()),
                                 expected=int(expected.view(torch.uint8)[c, r]),
                                 expected_value=float(expected[c, r].float())))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for source_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for by in ("none", "rows", "columns"):
                if by == "none" and source_dtype is torch.bfloat16:
                    continue
                row = _mismatches(shape, source_dtype, by)
                rows.append(row)
                print(f"{str(tuple(shape)):>14} {row['source']:>20} {by:>8}  differ from cpu {row['differ_from_cpu']:>8}"
                      f"  from torch cuda {row['differ_from_torch_cuda']:>8}  cpu vs torch cuda {row['cpu_vs_torch_cuda']:>8}")
                for first in row["first"]:
                    print("      ", first)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
