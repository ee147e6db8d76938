"""The CPU benchmarks run end to end on tiny settings and write results whose fields the README quotes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.stages.train import loop

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, check=True, capture_output=True)


def test_int8_anatomy(tmp_path: Path) -> None:
    _run("int8_anatomy.py", "--out", str(tmp_path), "--rounds", "2")
    res = json.loads((tmp_path / "int8_anatomy.json").read_text())
    assert abs(sum(res["op_type_share_of_kernel_time"].values()) - 1) < 0.01
    assert 0 < res["matmul_share"] < 1 and res["ceiling_if_matmuls_were_free"] > 1
    assert set(res["matmul_per_op"]) == {"64x64", "64x256"}


def test_int8_saturation_model(tmp_path: Path) -> None:
    """8-bit weights: some pair sums overflow int16 and cost accuracy; 7-bit weights: none do."""
    _run("int8_saturation.py", "--out", str(tmp_path))
    eight, seven = json.loads((tmp_path / "int8_saturation.json").read_text())["layers"]
    assert eight["saturated_pair_share"] > 0 and eight["cosine_saturating"] < eight["cosine_exact"] - 1e-3
    assert seven["saturated_pair_share"] == 0 and seven["cosine_saturating"] == seven["cosine_exact"]


def test_precision_bench_marks_the_ort_cpu_graph_kiln_uses(tmp_path: Path) -> None:
    _run("precision_bench.py", "--smoke", "--out", str(tmp_path))
    res = json.loads((tmp_path / "precision_cpu-smoke.json").read_text())
    picked = {r["row"]: r["kiln_ort_cpu"] for r in res["rows"]}
    assert picked == {"cnn": "ort_cpu_static", "transformer": "ort_cpu_dynamic"}
    for r in res["rows"]:
        assert {"int8", "ort_cpu_static", "ort_cpu_dynamic"} == set(r["variants"])
        assert sum(v["kiln_ort_cpu_engine"] for v in r["variants"].values()) == 1


def test_cache_check_bench_times_both_checks(tmp_path: Path) -> None:
    _run("cache_check_bench.py", "--mb", "4", "--repeats", "1", "--out", str(tmp_path))
    res = json.loads((tmp_path / "cache_check-4mb.json").read_text())
    assert res["median_seconds"]["content"] > 0 and res["median_seconds"]["size_only"] > 0
    assert res["workdir_mb"] >= 4 and "CPUs" in res["machine"]


def test_optimize_bench_compares_kiln_with_onnxsim_and_onnxslim(tmp_path: Path) -> None:
    _run("optimize_bench.py", "--smoke", "--models", "lstm", "--runs", "2", "--out", str(tmp_path))
    res = json.loads((tmp_path / "optimize.json").read_text())["results"]["lstm"]
    assert {"raw", "onnxsim", "onnxslim", "ort_offline", "kiln"} <= set(res["variants"])
    assert res["variants"]["kiln"]["nodes"] <= min(res["variants"][p]["nodes"] for p in ("onnxsim", "onnxslim"))
    assert res["kiln_vs_best_sim_slim_b8"]["peer"] in ("onnxsim", "onnxslim")
    assert "## Targets" in (tmp_path / "optimize.md").read_text()


@pytest.mark.slow
@pytest.mark.long
def test_engine_bench_two_input_hf_bert_with_the_validate_compile_baseline(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _run(
        "engine_bench.py",
        "--smoke",
        "--models",
        "hf_bert",
        "--rows",
        "eager32,baseline_compile,kiln,kiln_torch",
        "--out",
        str(tmp_path),
    )
    rows = json.loads((tmp_path / "engine_bench.json").read_text())["results"]
    assert {(r["row"], r["batch"]) for r in rows} == {
        (row, b) for row in ("eager32", "baseline_compile", "kiln", "kiln_torch") for b in (1, 4)
    }, rows
    assert all(r["median_ms"] > 0 and r["cosine"] > 0.9999 for r in rows)  # all FP32 on the CPU
    assert all(r["tflops"] > 0 and r["precision"] == "fp32" and r["pct_of_peak"] > 0 for r in rows)  # the roofline
    assert "validate.baselines compile" in (tmp_path / "engine_bench.md").read_text()


def test_step_host_cost_times_both_loops_and_kilns_parts(tmp_path: Path) -> None:
    _run("step_host_cost.py", "--smoke", "--no-compile", "--out", str(tmp_path))
    res = json.loads((tmp_path / "step_host_cost_smoke.json").read_text())
    assert [r["precision"] for r in res["rows"]] == ["fp16", "bf16"]
    for r in res["rows"]:
        assert all(r[k][loop]["us"] > 0 for k in ("tail", "head") for loop in ("bare", "kiln"))
        assert {"step check (as the loop calls it)", "flag + guard, op by op", "lagged read-back"} <= set(r["parts"])
        assert "flag + guard, graph replay" not in r["parts"]  # a CUDA graph only on the GPU
        assert r["tail_extra_us"] == round(r["tail"]["kiln"]["us"] - r["tail"]["bare"]["us"], 1)


def test_step_host_cost_on_the_explicit_attention_encoder(tmp_path: Path) -> None:
    """--model bert_base: the same comparison on the encoder whose compiled step issue 16 found most host-bound."""
    _run("step_host_cost.py", "--smoke", "--no-compile", "--model", "bert_base", "--batch", "4", "--out", str(tmp_path))
    res = json.loads((tmp_path / "step_host_cost_bert_base_smoke.json").read_text())
    assert res["model"]["model"] == "bert_base" and res["model"]["params"]["attention"] == "explicit"
    assert res["model"]["batch"] == 4
    assert all(r["head"][loop]["us"] > 0 for r in res["rows"] for loop in ("bare", "kiln"))
    assert "bert_base" in (tmp_path / "step_host_cost_bert_base_smoke.md").read_text()


def test_engine_bench_sorts_kernels_by_kind_and_tables_the_profile() -> None:
    """--profile's reading of kernel names: what a row's kernel time is spent on (the ONNX path's gap, issue 12)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_bench", ROOT / "benchmarks" / "engine_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kinds = {
        name: bench.kernel_kind(name)
        for name in (
            "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_nhwckrsc",
            "void cudnn::ops::nchwToNhwcKernel<__half>",
            "triton_tem_fused_addmm_gelu_3",
            "fmha_cutlassF_f16_aligned_64x64_rf_sm80",
            "triton_per_fused_layer_norm_4",
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>",
            "triton_poi_fused__to_copy_0",
            "void cudnn::bn_fw_inf_1C11_kernel_NHWC<__half, float, true, true>",
            "void cudnn::pooling_fw_kernel_max_nhwc<__half>",
            "void op_generic_tensor_kernel<4, __half, float>",
            "void implicit_convolve_sgemm<__half, __half, 128>",
            "triton_tem_fused_addmm_t_view_1",
            "triton_tem_fused__native_batch_norm_legit_no_training_convolution_relu_19",
        )
    }
    assert kinds == {
        "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_nhwckrsc": "convolution",
        "void cudnn::ops::nchwToNhwcKernel<__half>": "layout",
        "triton_tem_fused_addmm_gelu_3": "matmul",
        "fmha_cutlassF_f16_aligned_64x64_rf_sm80": "attention",
        "triton_per_fused_layer_norm_4": "normalization",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>": "other",
        "triton_poi_fused__to_copy_0": "copy / cast",
        "void cudnn::bn_fw_inf_1C11_kernel_NHWC<__half, float, true, true>": "normalization",
        "void cudnn::pooling_fw_kernel_max_nhwc<__half>": "pooling",
        "void op_generic_tensor_kernel<4, __half, float>": "other",
        "void implicit_convolve_sgemm<__half, __half, 128>": "convolution",
        "triton_tem_fused_addmm_t_view_1": "matmul",
        "triton_tem_fused__native_batch_norm_legit_no_training_convolution_relu_19": "convolution",
    }, kinds
    row = {
        "model": "m",
        "batch": 32,
        "row": "kiln_fixed",
        "median_ms": 1.9,
        "profile": {
            "kernel_ms": 1.5,
            "kernels": 80.0,
            "by_kind": {"convolution": [1.2, 20.0], "layout": [0.3, 60.0]},
            "top": [["conv_kernel", 0.2, 1.0]],
        },
    }
    assert bench.inductor_entries(
        "triton.enable_persistent_tma_matmul=true,max_autotune_gemm_backends=ATEN,TRITON,x=3"
    ) == {"triton.enable_persistent_tma_matmul": True, "max_autotune_gemm_backends": "ATEN,TRITON", "x": 3}
    for bad in ("max-autotune=true", "freezing", "a=1;b=2"):
        with pytest.raises(Exception, match="KEY=VALUE"):
            bench.inductor_entries(bad)
    table = "\n".join(bench.profile_table([row]))
    assert "| m | 32 | kiln_fixed | 1.900 | 1.500 | 80 | convolution 1.200 (20), layout 0.300 (60) |" in table
    assert bench.torch_variant("aten_frozen:freezing=true,max_autotune_gemm_backends=ATEN") == (
        "kiln_torch_aten_frozen",
        {"freezing": True, "max_autotune_gemm_backends": "ATEN"},
    )
    assert bench.torch_variant("epi:gemm_epilogues=bias_gelu") == ("kiln_torch_epi", {"gemm_epilogues": "bias_gelu"})
    for bad in ("aten", "Aten:x=1", "aten:x"):
        with pytest.raises(Exception, match="NAME:KEY=VALUE|KEY=VALUE"):
            bench.torch_variant(bad)


@pytest.mark.long
def test_train_loop_ab_runs_every_variant_and_undoes_its_patches(tmp_path: Path) -> None:
    """The bisection of issue 16's gap: each variant swaps parts of Kiln's loop for the bare loop's, then restores."""
    import importlib.util

    variants = ["kiln", "nograph+oldstats", "fb", "update", "direct", "step+batches+compile", "bare", "bare+spin"]
    _run("train_loop_ab.py", "--smoke", "--variants", ",".join(variants), "--pad-us", "100", "--out", str(tmp_path))
    res = json.loads((tmp_path / "train_loop_ab_smoke.json").read_text())
    assert list(res["variants"]) == variants
    # ratios of real windows: positive and finite (loose bounds: a 4-step window on a busy 2-core machine can be
    # slowed several-fold; a window that timed no work would give 0 or infinity)
    assert all(0.05 < r < 20 for v in res["variants"].values() for r in v["runs"])
    assert all(x > 0 for v in res["variants"].values() for x in v["kiln_steps_per_s"] + v["bare_steps_per_s"])
    spin = res["variants"]["bare+spin"]["details"][0]
    assert spin["pad_us_measured"] >= 100  # a spin lasts at least what it was asked for
    assert spin["expected_ratio"] == pytest.approx(
        1 / (1 + spin["pad_us_measured"] / 1e6 * spin["bare_steps_per_s"]), rel=0.02
    )
    spec = importlib.util.spec_from_file_location("train_loop_ab", ROOT / "benchmarks" / "train_loop_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    step, fb, make, compile_fn = loop._Trainer._step, loop._Trainer._forward_backward, loop.make_loader, torch.compile
    with ab.variant_patches("step+batches+compile"):
        assert loop._Trainer._step is ab.bare_step and loop.make_loader is not make and torch.compile is not compile_fn
    assert (loop._Trainer._step, loop._Trainer._forward_backward, loop.make_loader, torch.compile) == (
        step,
        fb,
        make,
        compile_fn,
    )
    from kiln.stages.train import health

    capture, push = health._capture, health.LaggedStats.push
    with ab.variant_patches("nograph+oldstats"):
        assert health._capture(lambda: None, torch.device("cpu")) is None
        assert health.LaggedStats.push is ab.allocating_push
        stats = health.LaggedStats(torch.device("cpu"), lag=0)
        stats.push(1, 0, 8, torch.tensor([0.5, 2.0]))
        assert [(s.step, loss_v, norm_v) for s, loss_v, norm_v in stats.drain()] == [(1, 0.5, 2.0)]
    assert (health._capture, health.LaggedStats.push) == (capture, push)
    toucher = ab.Toucher(50.0)  # the cache-missing pad: each call reads the next indices, not the same ones again
    toucher()
    toucher()
    assert toucher.at == 2 * toucher.n


def test_serve_legs_groups_saved_records_by_their_batch(tmp_path: Path) -> None:
    import numpy as np

    ms = 1_000_000
    rows = [(k * ms, 3 * ms, 50 * ms + k, 51 * ms + k) for k in range(3)]  # three executions of one request
    rows += [(k * ms, 20 * ms, 90 * ms, 99 * ms) for k in range(10, 30)]  # one execution of twenty
    np.save(tmp_path / "requests.npy", np.array(rows, dtype=np.int64))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_legs.py"), str(tmp_path / "requests.npy"), "--labels", "a"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| a | 1 | 13.0 % | 3 | 3.00 | 3.00 |" in out and "| a | 17-20 | 87.0 % | 1 | 20.00 | 20.00 |" in out


def test_the_cublaslt_probe_says_skip_without_an_fp8_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the probe itself")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cublaslt_fp8_probe.py")], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stderr.strip().startswith("skip: needs a CUDA GPU with FP8")


def test_serve_bench_starts_one_server_per_listed_setting_and_joins_each_ones_legs(tmp_path: Path) -> None:
    """The demo's engine behind two real `kiln serve`s (batches up to 4, then 2), stamped requests: each server's
    report says its batch limit and how long it took to be ready, and each one's legs come with the batches that
    answered them."""
    pytest.importorskip("tritonclient.http", reason="needs the serving libraries (pip install 'kiln[serve]')")
    _run(
        "serve_bench.py", "--demo", "--processes", "1", "--protocol", "http", "--transport", "shm",
        "--concurrency", "2", "--duration", "1", "--max-batch", "4,2", "--stamped", "--iterations", "5",
        "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
    )  # fmt: skip
    for run, batch in enumerate((4, 2)):
        report = json.loads((tmp_path / "out" / f"serve_demo_cpu_http_p1_shm_b{batch}_{run}.json").read_text())
        assert report["max_batch"] == batch and report["served"]["levels"][0]["mismatches"] == 0
        assert report["ready_s"] > 0  # how long the server took to answer
        server = report["served"]["server"]
        assert 0 < server["execution_count"] <= server["inference_count"] <= batch * server["execution_count"]
        legs = json.loads((tmp_path / "out" / f"serve_demo_cpu_legs_{run}.json").read_text())["legs"]
        assert legs["met"] > 0 and legs["by_batch"]
        assert max(int(g["batches"].split("-")[-1]) for g in legs["by_batch"]) <= batch  # no batch above the limit


@pytest.mark.slow
def test_cached_rerun_bench_times_a_user_project_both_ways(tmp_path: Path) -> None:
    _run("cached_rerun_bench.py", "--rounds", "1", "--out", str(tmp_path))
    res = json.loads((tmp_path / "cached_rerun.json").read_text())
    assert set(res["cached_rerun"]) == {"off", "on"} and res["fresh_run_s"] > 0
    assert all(len(r["runs"]) == 1 and r["median_s"] > 0 for r in res["cached_rerun"].values())


@pytest.mark.slow
@pytest.mark.long
def test_cpu_train_modes_runs_each_mode_and_tables_them(tmp_path: Path) -> None:
    """One round of one epoch of each mode (eager, compiled, DDP over two processes) on the demo."""
    _run("cpu_train_modes.py", "--rounds", "1", "--epochs", "1", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "cpu_train_modes.json").read_text())["rows"]
    assert len(rows) == 3 and all("error" not in r and r["train_s"] > 0 for runs in rows.values() for r in runs), rows
    assert next(iter(rows["compile, 1 process"]))["compile_s"] > 0
