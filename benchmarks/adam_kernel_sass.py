"""What the hand-written AdamW kernel (flash_inductor/triton_adam.py) executes per element, without a GPU.

Compiles ``_adam_kernel`` for sm_90 (H100/H200) with the ptxas that ships with Triton's NVIDIA
backend, for each launch shape given, as the flat step launches it for bf16 weights with int8 error
terms and 8-bit states (AdamW, one step count per bucket; pointers 16-byte aligned and the group count
a multiple of 16, as Triton specializes them), and prints its registers and SASS instructions per
element: in all (issue slots; four warp instructions per clock and SM) and those of the unit that runs
MUFU and every conversion (I2F, F2I, FRND, F2F: 16 results per clock and SM on sm_90, an eighth of the
fp32 rate), by opcode. Without persistent loops the kernel is straight-line code, so the static
counts over the elements a thread holds are the executed ones. Needs triton (and no GPU):

    python benchmarks/adam_kernel_sass.py --shapes block64_warps4,block64_warps4_approx
    python benchmarks/adam_kernel_sass.py --rev HEAD~1   # also the kernel at a git revision, beside it

Each shape's line also counts its global loads by width (``LDG.E.128``: 16 bytes a thread).
"""

import argparse
import collections
import importlib.util
import re
import subprocess
import tempfile

import torch
from kernel_resources import _tool

from flash_inductor import triton_adam

# (grads: the flat gradient buffer the kernel read before it read each gradient where it is)
ARGUMENT_TYPES = dict(weights="*bf16", errors="*i8", grads="*bf16", grad_addresses="*i64", starts="*i32", numels="*i32",
                      num_segments="i32", m_codes="*i8", m_scales="*fp16", v_codes="*u8",
                      v_scales="*fp16", beta_powers="*fp64", active="*i1", num_groups="i32", lr="fp32",
                      one_minus_beta1="fp32", beta2="fp32", one_minus_beta2="fp32", eps="fp32", weight_decay="fp32")
SEARCH_STEPS = 7
CONVERSION_UNIT = {"MUFU", "I2F", "F2I", "FRND", "F2F"}  # opcodes (I2FP and F2FP, the packed forms, run elsewhere)


def compile_sm90(shape, module=triton_adam, per_group=False, decoupled=True, output="cubin"):
    """The cubin (or ``output="ptx"``) of ``module._adam_kernel`` launched as ``shape`` (triton.compile
    for an sm_90 target), for an AdamW (``decoupled``) or Adam step with one step count per bucket or
    per group."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = module._adam_kernel.arg_names
    constants = module.kernel_constants(shape, torch.bfloat16, True, per_group, decoupled, False)
    if "SEARCH_STEPS" in names:  # the gradients read where they are: a bucket of up to 128 tensors
        constants["SEARCH_STEPS"] = SEARCH_STEPS
    signature = {name: ARGUMENT_TYPES.get(name, "constexpr") for name in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if ARGUMENT_TYPES.get(n, "").startswith("*") or n == "num_groups"}
    source = ASTSource(module._adam_kernel, signature, {(names.index(k),): v for k, v in constants.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": shape.num_warps}).asm[output]


def sass_counts(cubin, path="/tmp/adam_kernel_sm90.cubin"):
    """(registers, Counter of SASS opcodes with their modifiers, e.g. ``MUFU.RCP``)."""
    with open(path, "wb") as f:
        f.write(cubin)
    usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    ops = collections.Counter(m[1] for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    return int(re.search(r"REG:(\d+)", usage)[1]), ops


def module_at(rev):
    """flash_inductor/triton_adam.py as it was at ``rev``, imported under another name."""
    source = subprocess.run(["git", "show", f"{rev}:flash_inductor/triton_adam.py"], capture_output=True, text=True,
                            check=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("flash_inductor.triton_adam_at_rev", path.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="block64_warps4,block64_warps4_approx",
                        help="comma list of triton_adam.LaunchShape names (no persistent ones: their loop is not unrolled)")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per shape")
    parser.add_argument("--rev", help="also the kernel at this git revision (its line after the working tree's)")
    args = parser.parse_args()
    modules = [("", triton_adam)] + ([(f" at {args.rev}", module_at(args.rev))] if args.rev else [])
    for name in args.shapes.split(","):
        for label, module in modules:
            shape = module.LaunchShape.from_name(name)
            per_thread = shape.block_groups * 32 // (32 * shape.num_warps)
            registers, ops = sass_counts(compile_sm90(shape, module))
            unit = {op: n for op, n in ops.items() if op.split(".")[0] in CONVERSION_UNIT}
            loads = {op: n for op, n in ops.items() if op.startswith("LDG")}
            print(f"{shape.name}{label}: {registers} registers, {per_thread} elements per thread, per element "
                  f"{sum(ops.values()) / per_thread:.1f} instructions, {sum(unit.values()) / per_thread:.2f} on the "
                  f"conversion/MUFU unit ({', '.join(f'{op} {n / per_thread:.2g}' for op, n in sorted(unit.items()))}); "
                  f"loads per thread {', '.join(f'{op} {n}' for op, n in sorted(loads.items()))}")
            print("  " + ", ".join(f"{op} {n / per_thread:.2g}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
