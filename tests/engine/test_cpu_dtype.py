"""The default CPU dtype follows what the CPU computes natively."""

from pathlib import Path

from engine.vllm_engine import best_cpu_dtype


def test_bf16_only_where_the_cpu_has_native_bf16(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n")
    assert best_cpu_dtype(str(cpuinfo)) == "bfloat16"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 amx_bf16 amx_tile\n")
    assert best_cpu_dtype(str(cpuinfo)) == "bfloat16"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert best_cpu_dtype(str(cpuinfo)) == "float32"
    assert best_cpu_dtype(str(tmp_path / "missing")) == "float32"
