"""benchmarks/code_log_stores.py on a hand-written code log: which FP8 kernels store one value twice."""

import gzip

from helpers import benchmark_module

# name: the lines of its body (after the value it computes, tmp1, and before the end of its source)
KERNELS = {
    "triton_poi_0": ["tmp1 = tmp0.to(tl.float8e5)", "tl.store(out_ptr0 + (x0), tmp1, xmask)",
                     "tl.store(out_ptr1 + (x0), tmp1, xmask)"],
    "triton_poi_1": ["tmp1 = tmp0.to(tl.float8e4nv)", "tl.store(out_ptr0 + (x0), tmp1, xmask)",
                     "tl.store(out_ptr1 + (x0), tmp2, None)"],
    "triton_poi_2": ["tmp1 = tmp0 * 2", "tl.store(out_ptr0 + (x0), tmp1, xmask)", "tl.store(out_ptr1 + (x0), tmp1, xmask)"],
    # two scalars: the offset's own commas are no argument's end
    "triton_per_3": ["tmp1 = tmp0.to(tl.float8e4nv)", "tl.store(out_ptr0 + (tl.full([1], 0, tl.int32)), tmp1, None)",
                     "tl.store(out_ptr1 + (tl.full([1], 0, tl.int32)), tmp2, None)"],
}


def _code_log():
    """The kernels as ``TORCH_LOGS=output_code`` logs Inductor's code: a prefix on every line; then a
    second graph's kernel of the first one's name, storing two values."""
    lines = []
    for name, body in [*KERNELS.items(), ("triton_poi_0", KERNELS["triton_poi_1"])]:
        lines += [f"{name} = async_compile.triton('{name}', '''",
                  f"def {name}(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):",
                  *(f"    {line}" for line in body),
                  "''', device_str='cuda')"]
    return "".join(f"V1204 graph.py:2552] [4/0] [__output_code] {line}\n" for line in lines)


def test_fp8_kernels_storing_one_value_twice_are_counted(tmp_path, capsys, monkeypatch):
    script = benchmark_module("code_log_stores")
    path = tmp_path / "code.log.gz"
    with gzip.open(path, "wt") as f:
        f.write(_code_log())
    monkeypatch.setattr("sys.argv", ["code_log_stores.py", str(path)])
    script.main()
    assert capsys.readouterr().out.splitlines() == [
        "triton_poi_0: out_ptr0=tmp1, out_ptr1=tmp1  value stored twice",
        "triton_poi_1: out_ptr0=tmp1, out_ptr1=tmp2",
        "triton_per_3: out_ptr0=tmp1, out_ptr1=tmp2",
        "triton_poi_0: out_ptr0=tmp1, out_ptr1=tmp2",  # not marked for its name's kernel in the first graph
        "4 FP8 kernels, 1 storing one value twice",  # triton_poi_2 handles no FP8
    ]
