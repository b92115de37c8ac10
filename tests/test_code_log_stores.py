"""benchmarks/code_log_stores.py on a hand-written code log: which FP8 kernels store one value twice."""

import gzip

from helpers import benchmark_module

LOG = '''V1204 [__output_code] triton_poi_0 = async_compile.triton('triton_poi_0', \'\'\'
V1204 [__output_code] def triton_poi_0(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
V1204 [__output_code]     tmp1 = tmp0.to(tl.float8e5)
V1204 [__output_code]     tl.store(out_ptr0 + (x0), tmp1, xmask)
V1204 [__output_code]     tl.store(out_ptr1 + (x0), tmp1, xmask)
V1204 [__output_code] \'\'\', device_str='cuda')
V1204 [__output_code] triton_poi_1 = async_compile.triton('triton_poi_1', \'\'\'
V1204 [__output_code] def triton_poi_1(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
V1204 [__output_code]     tmp1 = tmp0.to(tl.float8e4nv)
V1204 [__output_code]     tl.store(out_ptr0 + (x0), tmp1, xmask)
V1204 [__output_code]     tl.store(out_ptr1 + (x0), tmp2, None)
V1204 [__output_code] \'\'\', device_str='cuda')
V1204 [__output_code] triton_poi_2 = async_compile.triton('triton_poi_2', \'\'\'
V1204 [__output_code] def triton_poi_2(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
V1204 [__output_code]     tmp1 = tmp0 * 2
V1204 [__output_code]     tl.store(out_ptr0 + (x0), tmp1, xmask)
V1204 [__output_code]     tl.store(out_ptr1 + (x0), tmp1, xmask)
V1204 [__output_code] \'\'\', device_str='cuda')
'''


def test_fp8_kernels_storing_one_value_twice_are_counted(tmp_path, capsys, monkeypatch):
    script = benchmark_module("code_log_stores")
    path = tmp_path / "code.log.gz"
    with gzip.open(path, "wt") as f:
        f.write(LOG)
    monkeypatch.setattr("sys.argv", ["code_log_stores.py", str(path)])
    script.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "triton_poi_0: out_ptr0=tmp1, out_ptr1=tmp1  value stored twice",
        "triton_poi_1: out_ptr0=tmp1, out_ptr1=tmp2",
        "2 FP8 kernels, 1 storing one value twice",  # triton_poi_2 handles no FP8
    ]
