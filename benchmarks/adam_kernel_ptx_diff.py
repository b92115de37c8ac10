"""Whether the hand-written AdamW kernel (flash_inductor/triton_adam.py's ``_adam_kernel``) compiles to the
same PTX code as at a git revision, without a GPU: for each launch shape given, AdamW and Adam, one step
count per bucket and per group, compiled for sm_90 with the ptxas that ships with Triton (as
benchmarks/adam_kernel_sass.py does). Identical code stores identical bits, so a refactor of the kernel's
source that keeps it needs no new GPU run to keep its launch-shape and reference tests' results. Debug
sections (source paths and lines) are left out of the comparison. Needs triton (and git):

    python benchmarks/adam_kernel_ptx_diff.py --rev HEAD
"""

import argparse
import itertools
import sys

from adam_kernel_sass import compile_sm90, module_at

from flash_inductor import triton_adam

SHAPES = "block64_warps4,block64_warps4_approx,block16_warps2_vector8_evict_persist2_stages2_approx," \
         "block32_warps2_vector16_evict_persist2_stages3"


def code(ptx):
    """The PTX without its debug sections and comments."""
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return [line for line in ptx.splitlines() if line.strip() and not line.strip().startswith((".loc", ".file", "//"))
            and not line.strip().startswith(("$L__tmp", "$L__func"))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree's kernel with")
    parser.add_argument("--shapes", default=SHAPES, help="comma list of triton_adam.LaunchShape names")
    args = parser.parse_args()
    before = module_at(args.rev)
    differ = 0
    for name, per_group, decoupled in itertools.product(args.shapes.split(","), (False, True), (True, False)):
        ptx = [code(compile_sm90(m.LaunchShape.from_name(name), m, per_group, decoupled, "ptx")) for m in (before, triton_adam)]
        same = ptx[0] == ptx[1]
        differ += not same
        print(f"{name:55} {'per group ' if per_group else 'per bucket'} {'AdamW' if decoupled else 'Adam '} "
              f"{'identical' if same else f'DIFFERS ({len(ptx[0])} vs {len(ptx[1])} lines)'}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
