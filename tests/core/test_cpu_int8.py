"""Which CPUs saturate ONNX Runtime's INT8 sums, and the exact kernels Kiln's sessions ask for on them."""

from __future__ import annotations

import pytest

from kiln.core.cpu_int8 import PRECISE_INT8, cpuinfo_flags, saturates, slow_integer_convs
from kiln.core.onnx_io import session_options

SKYLAKE_SP = "processor\t: 0\nvmx flags\t: ept vpid\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_vnni\n"
ALDER_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx_vnni\n"


@pytest.mark.parametrize(
    "machine, cpuinfo, want",
    [
        ("x86_64", SKYLAKE_SP, True),
        ("x86_64", ICE_LAKE, False),
        ("x86_64", ALDER_LAKE, False),
        ("x86_64", "processor\t: 0\n", True),  # no flags line: the safe side
        ("aarch64", "processor\t: 0\n", False),
        ("arm64", SKYLAKE_SP, False),
    ],
)
def test_only_x86_cpus_without_vnni_saturate(machine: str, cpuinfo: str, want: bool) -> None:
    assert saturates(machine, cpuinfo_flags(cpuinfo)) is want


def test_flags_come_from_the_flags_line_only() -> None:
    assert cpuinfo_flags(SKYLAKE_SP) == ["fpu", "sse2", "avx", "avx2", "avx512f", "avx512bw", "avx512vl"]
    assert saturates("AMD64", None) and saturates("AMD64", ["avx2"]) and not saturates("AMD64", ["avx512_vnni"])


def test_sessions_ask_for_exact_int8_kernels_only_where_they_saturate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: True)
    assert session_options().get_session_config_entry(PRECISE_INT8) == "1"
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: False)
    with pytest.raises(RuntimeError):  # ORT: an entry never set
        session_options().get_session_config_entry(PRECISE_INT8)


def test_the_exact_kernels_run_an_int8_graph(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """ORT takes the entry on any CPU (on one with VNNI it changes nothing) and runs a real INT8 graph with it."""
    from kiln.calibration.config import CalibrationConfig
    from kiln.calibration.quantize import quantize_int8
    from kiln.calibration.ranges import calibrate
    from kiln.stages.precision.compare import output_metrics, run_batched
    from tests.calibration.calib_graphs import batches, saved

    path = saved(tmp_path)
    ranges = calibrate(path, batches(), "input", "minmax", cache_dir=tmp_path / "cache")
    quantize_int8(path, tmp_path / "int8.onnx", ranges, CalibrationConfig())
    x = batches(1, seed=1)[0]
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: True)
    ref, got = run_batched(path, x)[0], run_batched(tmp_path / "int8.onnx", x)[0]
    assert output_metrics(ref, got)["cosine"] > 0.98


@pytest.mark.parametrize("dims, want", [(1, []), (2, []), (3, ["conv3d"])])
def test_only_quantized_3d_convolutions_lack_a_fast_integer_kernel(tmp_path, dims: int, want: list[str]) -> None:
    """A Q/DQ graph's Conv over 3 spatial dims is named; so is its QLinearConv form (ORT's QOperator graph)."""
    import onnx

    from tests.stages.precision.test_stage_slow_convs import quantized

    model = onnx.load(str(quantized(tmp_path, dims)))
    assert slow_integer_convs(model) == want
    if dims == 3:
        weight = next(i for i in model.graph.initializer if len(i.dims) == 5)
        qlinear = onnx.helper.make_node("QLinearConv", ["x", "s", "z", weight.name, "ws", "wz", "ys", "yz"], ["y"])
        model.graph.node.append(qlinear)
        assert slow_integer_convs(model) == ["conv3d", "y"]
