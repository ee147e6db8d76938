"""The cuBLASLt binding (kiln.stages.engines.torch.cublaslt) on a GPU: its algorithm chosen by measurement answers as
the heuristic's first does. Its speed is the GPU's (benchmarks/cublaslt_fp8_probe.py --algos)."""

from __future__ import annotations

from functools import partial

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8", "fp16"])
def test_the_measured_algorithm_answers_as_the_heuristics_first(precision: str) -> None:
    from kiln.stages.engines.torch import cublaslt
    from kiln.stages.engines.torch.lowbit import supported

    if not torch.cuda.is_available() or (precision == "fp8" and supported("fp8")):
        pytest.skip((precision == "fp8" and supported("fp8")) or "needs a CUDA GPU")
    torch.manual_seed(0)
    m, n, k = 256, 2304, 768
    dtype = torch.float8_e4m3fn if precision == "fp8" else torch.float16
    in_type = cublaslt.CUDA_R_8F_E4M3 if precision == "fp8" else cublaslt.CUDA_R_16F
    x, w = torch.randn(m, k, device="cuda").to(dtype), (torch.randn(n, k, device="cuda") / 8).to(dtype)
    scale = torch.tensor(1.0, device="cuda") if precision == "fp8" else None
    bias = torch.randn(n, device="cuda").half()
    g = cublaslt.LtGemm(m, n, k, cublaslt.CUDA_R_16F, cublaslt.EPILOGUE_BIAS, cublaslt.CUDA_R_16F, in_type)
    first, tuned = (torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(2))
    g(x, w, scale, scale, bias, None, first)
    picked = g.tune(partial(g, x, w, scale, scale, bias, None, tuned), most=8)
    assert 0 <= picked < len(g.results) and g.result is g.results[picked]
    tuned.zero_()
    g(x, w, scale, scale, bias, None, tuned)
    want = x.float() @ w.float().t() + bias.float()
    for out in (first, tuned):
        assert torch.nn.functional.cosine_similarity(out.float().flatten(), want.flatten(), 0) > 0.9999


class _Gemm:
    """What :func:`cublaslt.measured` uses of a GEMM: its key, candidates, the algorithm in use and tune."""

    def __init__(self, found: int = 16) -> None:
        self.key, self.tuned, self.choice, self.found, self.used, self.timed = (
            (4096, 768, 768),
            False,
            None,
            found,
            0,
            0,
        )

    def candidates(self, most: int) -> int:
        return min(most, self.found)

    def use(self, index: int) -> None:
        self.used = index

    def tune(self, call: object, device: object) -> int:
        assert self.used == 0, "timing starts from the heuristic's first"
        self.timed += 1
        self.choice = 0
        return 0


@pytest.fixture
def lt(monkeypatch: pytest.MonkeyPatch):
    """The binding with this process's GPU model and cuBLASLt faked (the GEMMs themselves are not called)."""
    from types import SimpleNamespace

    from kiln.stages.engines.torch import cublaslt

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(cublaslt, "library", lambda: SimpleNamespace(cublasLtGetVersion=lambda: 130100))
    monkeypatch.setattr(cublaslt, "_adopted", {})
    return cublaslt


def test_a_built_engines_choices_are_adopted_on_the_same_gpu_and_timed_again_elsewhere(lt) -> None:
    """The served engine runs the algorithms its build chose (and validation ran), without timing them again, where
    the GPU model and cuBLASLt are the build's; moved elsewhere, or for a shape the build did not meet, it times."""
    recorded = {"gpu": "NVIDIA H200", "cublaslt": 130100, "algorithms": {"4096,768,768": 5}}
    assert lt.adopt(recorded)
    g = _Gemm()
    lt.measured(g, lambda: None, "cuda")
    assert (g.used, g.choice, g.timed) == (5, 5, 0) and g.tuned
    lt.measured(g, lambda: None, "cuda")  # chosen once
    assert g.timed == 0
    other = _Gemm()
    other.key = (128, 768, 768)
    lt.measured(other, lambda: None, "cuda")
    assert other.timed == 1
    few = _Gemm(found=3)  # this library's heuristic offers fewer: the recorded index is not there
    lt.measured(few, lambda: None, "cuda")
    assert few.timed == 1
    lt._adopted.clear()
    assert not lt.adopt({**recorded, "gpu": "NVIDIA H100 80GB HBM3"})
    moved = _Gemm()
    lt.measured(moved, lambda: None, "cuda")
    assert moved.timed == 1 and not lt._adopted


def test_an_adopted_algorithm_that_refuses_the_call_is_timed_instead(lt) -> None:
    lt.adopt({"gpu": "NVIDIA H200", "cublaslt": 130100, "algorithms": {"4096,768,768": 2}})

    def refuse() -> None:
        raise lt.Unavailable("misaligned")

    g = _Gemm()
    lt.measured(g, refuse, "cuda")
    assert g.timed == 1 and g.choice == 0
