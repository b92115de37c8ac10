"""What Inductor's generated code stores twice: the FP8 Triton kernels of a code log and their stores.

Reads a ``TORCH_LOGS=output_code`` log (``h200_session.sh fp8kernels`` writes one, gzipped) and
prints, for each Triton kernel that handles FP8 values, the pointers it stores to and whether two of
its stores write the same value (the double store ``passes/fp8_transpose_source.py`` removes), then
the totals::

    python benchmarks/code_log_stores.py benchmarks/results/hf_clients_llama2l_kernels_source_h200_code.log.gz
"""

import argparse
import gzip
import re

_KERNEL = re.compile(r"def (triton_\w+)\(.*?\):\n(.*?)''', device_str", re.S)
_LOG_PREFIX = re.compile(r"^.*?\[__output_code\] ", re.M)


def fp8_kernels(code):
    """[(kernel name, [(pointer, stored value)])] of the Triton kernels in ``code`` that touch FP8."""
    return [(name, stores(body)) for name, body in _KERNEL.findall(code) if "float8" in body]


def stores(body):
    """[(pointer, stored value)] of each ``tl.store(pointer + offset, value, mask)`` in a kernel's body."""
    found = []
    for start in (m.end() for m in re.finditer(r"tl\.store\(", body)):
        arguments, depth, begin = [], 0, start
        for i in range(start, len(body)):
            if body[i] in "([":
                depth += 1
            elif body[i] in ")]" and depth:
                depth -= 1
            elif body[i] in ",)" and depth == 0:
                arguments.append(body[begin:i].strip())
                begin = i + 1
                if body[i] == ")":
                    break
        found.append((re.match(r"\w+", arguments[0]).group(), arguments[1]))
    return found


def stores_a_value_twice(stores):
    """Whether two stores of a kernel write the same value to different pointers."""
    values = [value for _, value in stores]
    return len(set(values)) < len(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="an output_code log, plain or .gz")
    args = parser.parse_args()
    opener = gzip.open if args.log.endswith(".gz") else open
    with opener(args.log, "rt") as f:
        code = _LOG_PREFIX.sub("", f.read())
    kernels = fp8_kernels(code)
    twice = 0
    for name, stores in kernels:  # by kernel, not name: each compiled graph numbers its kernels from 0
        doubled = stores_a_value_twice(stores)
        twice += doubled
        print(f"{name}: {', '.join(f'{p}={v}' for p, v in stores)}{'  value stored twice' if doubled else ''}")
    print(f"{len(kernels)} FP8 kernels, {twice} storing one value twice")


if __name__ == "__main__":
    main()
