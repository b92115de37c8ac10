"""What the compiled Triton kernels cost per thread (GPU): registers, spills, SASS instructions.

Scans Triton's caches (Inductor's under ``/tmp/torchinductor_$USER/triton``, ``TRITON_CACHE_DIR``,
``~/.triton/cache``) for kernels whose name
contains ``--match`` and prints, per kernel: warps, the tile (``XBLOCK x R0_BLOCK`` of its largest
tensor), registers and spilled bytes (``cuobjdump -res-usage``), and its SASS instruction count with
the counts of the instructions behind exact division and square root (``MUFU.RCP``/``MUFU.RSQ``
followed by fix-ups, and calls into their slow paths). Static counts, not executed ones: a kernel's
work per element is about its count divided by the elements each thread holds.

    python benchmarks/kernel_resources.py --match lshift --out kernels.json

Uses the ``cuobjdump`` and ``nvdisasm`` that ship with Triton's NVIDIA backend.
"""

import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import subprocess


def _tool(name):
    import triton

    bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else shutil.which(name)


def _resources(cubin):
    text = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def _sass_opcodes(cubin):
    text = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def _tile(ttgir):
    shapes = collections.Counter(re.findall(r"tensor<(\d+(?:x\d+)*)x(?:f32|i32|i8|i1)", ttgir))
    return shapes.most_common(1)[0][0] if shapes else "?"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--match", default="lshift")
    parser.add_argument("--cache", action="append", help="a Triton cache folder (repeatable; default: the usual ones)")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folders = args.cache or [pathlib.Path(cache_dir()) / "triton", os.environ.get("TRITON_CACHE_DIR", ""),
                             pathlib.Path.home() / ".triton" / "cache"]
    cubins = {c for folder in folders if folder and pathlib.Path(folder).is_dir() for c in pathlib.Path(folder).rglob("*.cubin")}
    for cubin in sorted(cubins):
        if args.match not in cubin.stem:
            continue
        meta = json.loads(cubin.with_suffix(".json").read_text()) if cubin.with_suffix(".json").exists() else {}
        ttgir = cubin.with_suffix(".ttgir")
        regs, local = _resources(cubin)
        ops = _sass_opcodes(cubin)
        row = dict(kernel=cubin.stem[-60:], cache=cubin.parent.name[:12], num_warps=meta.get("num_warps"),
                   tile=_tile(ttgir.read_text()) if ttgir.exists() else "?", registers=regs, local_bytes=local,
                   sass_instructions=sum(ops.values()), mufu=ops["MUFU"], calls=ops["CALL"], ffma=ops["FFMA"],
                   fmul=ops["FMUL"], fadd=ops["FADD"], fsetp=ops["FSETP"], fsel=ops["FSEL"] + ops["SEL"],
                   loads=ops["LDG"], stores=ops["STG"], top=ops.most_common(8))
        rows.append(row)
        print(f"{row['cache']} {row['kernel']:60s} warps {row['num_warps']} tile {row['tile']:>9s} regs {regs} "
              f"local {local} sass {row['sass_instructions']} mufu {row['mufu']} call {row['calls']} "
              f"ldg {row['loads']} stg {row['stores']} top {row['top']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
