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
