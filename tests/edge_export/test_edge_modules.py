"""Plain modules: an MLP and a small CNN through litert_torch.convert, each quantization, runtime parity."""

import json
import os

import numpy as np
import pytest
import torch

from edge_export import export_module
from edge_export.bench import bench_module
from edge_export.runtime import TFLiteModule
from edge_export_factories import small_cnn
from edge_export_helpers import run_cli


def test_mlp_fp32_report(mlp_fp32):
    model, x, path = mlp_fp32
    with open(path + ".report.json") as f:
        report = json.load(f)
    assert report["installed"] and report["verification"]["passed"]
    assert report["verification"]["relative_error"] < 1e-5
    assert report["file_bytes"] == os.path.getsize(path) and report["inputs"] == ["4x16:float32"]


@pytest.mark.parametrize("quantization", ["dynamic-int8", "weight-int8", "dynamic-int4"])
def test_mlp_each_quantization_verified(quantization, tmp_path, mlp_fp32):
    model, x, fp32_path = mlp_fp32
    result = export_module(model, (x,), str(tmp_path / "mlp.tflite"), quantize=quantization, quiet=True)
    check = result.report["verification"]
    assert check["passed"], check["failures"]
    # the installed file, loaded afresh, reproduces PyTorch on a new input within the same bound
    y = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    lite = TFLiteModule(result.output)(y.numpy())[0]
    ref = model(y).detach().numpy()
    assert np.abs(lite - ref).max() <= check["tolerance"]["relative_error"] * np.abs(ref).max()
    assert check["max_abs_error"] > 0  # really quantized
    assert os.path.getsize(result.output) < 0.6 * os.path.getsize(fp32_path)
    with open(result.report_path) as f:
        assert json.load(f)["quantization"] == quantization


def test_cnn_via_cli_fp32_and_int8(tmp_path, capsys):
    sizes = {}
    for quantization in ("none", "dynamic-int8"):
        out = tmp_path / f"cnn_{quantization}.tflite"
        code, stdout, _ = run_cli(
            capsys,
            "export",
            "edge_export_factories:small_cnn",
            "-o",
            out,
            "--input",
            "2x3x32x32:float32",
            "--quantize",
            quantization,
            "--benchmark",
        )
        assert code == 0
        assert stdout.strip().splitlines()[-1].startswith(f"{out}: module tflite, {quantization}")
        report = json.loads((tmp_path / f"cnn_{quantization}.tflite.report.json").read_text())
        assert report["verification"]["passed"] and report["inputs"] == ["2x3x32x32:float32"]
        assert report["benchmark"]["litert_ms"] > 0 and report["benchmark"]["torch_ms"] > 0
        sizes[quantization] = out.stat().st_size
    assert sizes["dynamic-int8"] < 0.5 * sizes["none"]
    model, x = small_cnn().eval(), torch.randn(2, 3, 32, 32)
    lite = TFLiteModule(str(tmp_path / "cnn_none.tflite"))(x.numpy())[0]
    assert np.abs(lite - model(x).detach().numpy()).max() < 1e-4


def test_bench_module_and_cli_bench(capsys, mlp_fp32):
    model, x, path = mlp_fp32
    result = bench_module(path, (x,), model, repeats=3)
    assert result["litert_ms"] > 0 and result["torch_ms"] > 0 and result["file_bytes"] == os.path.getsize(path)
    code, stdout, _ = run_cli(capsys, "bench", path, "--source", "edge_export_factories:mlp", "--input", "4x16:float32")
    assert code == 0 and "LiteRT / PyTorch" in stdout
    code, stdout, _ = run_cli(capsys, "bench", path)  # no source: LiteRT only, inputs from the file's shapes
    assert code == 0 and "LiteRT ms/call" in stdout and "PyTorch" not in stdout


def test_failed_verification_keeps_existing_output(tmp_path, capsys):
    out = tmp_path / "mlp.tflite"
    out.write_bytes(b"previous good file")
    code, _, err = run_cli(
        capsys,
        "export",
        "edge_export_factories:mlp",
        "-o",
        out,
        "--input",
        "4x16:float32",
        "--quantize",
        "dynamic-int4",
        "--tolerance",
        "1e-9",
    )
    assert code == 3
    assert "verification failed" in err and "exceeds 1e-09 by" in err
    assert out.read_bytes() == b"previous good file"
    report = json.loads((tmp_path / "mlp.tflite.report.json").read_text())
    assert report["installed"] is False and report["verification"]["passed"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.tflite", "mlp.tflite.report.json"]


def test_no_verify_skips_runtime_check(tmp_path, capsys):
    out = tmp_path / "mlp.tflite"
    code, stdout, _ = run_cli(
        capsys, "export", "edge_export_factories:mlp", "-o", out, "--input", "4x16:float32", "--no-verify", "--quiet"
    )
    assert code == 0 and "not verified" in stdout
    assert json.loads((tmp_path / "mlp.tflite.report.json").read_text())["verification"] is None
