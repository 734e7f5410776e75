"""Every bad-input and failure kind gets one line naming the cause and the fix, and a non-zero exit."""

import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import pytest

from edge_export import ExportError, errors
from edge_export.runtime import TFLiteModule
from edge_export.sources import inspect_checkpoint, parse_input_spec
from edge_export.verify import TOLERANCES, verify_module
from edge_export_helpers import one_line_error, run_cli


def export_factory(capsys, tmp_path, factory, *inputs, extra=()):
    args = ["export", f"edge_export_factories:{factory}", "-o", tmp_path / "m.tflite"]
    for spec in inputs:
        args += ["--input", spec]
    return run_cli(capsys, *args, *extra)


def test_op_without_lowering_names_op_and_module(tmp_path, capsys):
    code, _, err = export_factory(capsys, tmp_path, "noisy_net", "2x8:float32")
    line = one_line_error(err)
    assert code == 1
    assert "aten.randn_like" in line and "module 'noise' (Noise)" in line and "pass the noise in" in line
    assert not (tmp_path / "m.tflite").exists()


def test_data_dependent_shape(tmp_path, capsys):
    code, _, err = export_factory(capsys, tmp_path, "positive_only", "2x4:float32")
    line = one_line_error(err)
    assert code == 1 and "depends on tensor values" in line and "torch.where" in line


def test_dynamic_dim_suggests_static_shapes_or_buckets(tmp_path, capsys):
    code, _, err = export_factory(capsys, tmp_path, "mlp", "batch=2x16:float32")
    line = one_line_error(err)
    assert code == 1 and "dynamic dimension" in line and "static shapes" in line and "--prefill-lengths" in line


def test_int64_inputs_are_reported_as_int32(tmp_path, capsys):
    code, stdout, _ = export_factory(capsys, tmp_path, "token_scale", "2x4:int64")
    assert code == 0
    assert "input 0 is int64 in PyTorch; the LiteRT file takes and computes it as int32" in stdout
    runner = TFLiteModule(str(tmp_path / "m.tflite"))
    assert runner.input_dtypes == [np.int32]
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert (runner(ids)[0] == ids * 2 + 1).all()


def _with_custom_op(src: str, dst: str, op_name: str) -> None:
    """Rewrite every operator code of a .tflite into a custom op the runtime has no kernel for."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    with open(src, "rb") as f:
        model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(f.read(), 0))
    for code in model.operatorCodes:
        code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM
        code.customCode = op_name
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    with open(dst, "wb") as f:
        f.write(builder.Output())


def test_opcode_missing_from_runtime_is_named(tmp_path, mlp_fp32):
    model, x, good = mlp_fp32
    bad = str(tmp_path / "bad.tflite")
    _with_custom_op(good, bad, "EdgeExportTestOp")
    with pytest.raises(ExportError) as caught:
        verify_module(bad, model, (x,), TOLERANCES["none"])
    assert caught.value.kind == errors.MISSING_RUNTIME_OP
    assert "opcode 'EdgeExportTestOp'" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("no/such/folder", "neither a model folder nor 'package.module:factory'"),
        ("no_such_package_xyz.models:make", "cannot import 'no_such_package_xyz.models'"),
        ("edge_export_factories:nope", "has no callable 'nope'"),
        ("edge_export_factories:not_a_module", "has no callable 'not_a_module'"),
    ],
)
def test_bad_source(tmp_path, capsys, source, expected):
    code, _, err = run_cli(capsys, "export", source, "-o", tmp_path / "m.tflite", "--input", "1x4:float32")
    assert code == 1 and expected in one_line_error(err)


def test_factory_needing_arguments_is_a_bad_source(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", "torch.nn:Linear", "-o", tmp_path / "m.tflite", "--input", "1x3:float32")
    line = one_line_error(err)
    assert code == 1 and "SOURCE 'torch.nn:Linear': Linear() needs arguments (in_features, out_features)" in line
    assert "function of no arguments" in line
    assert not (tmp_path / "m.tflite").exists()


@pytest.mark.parametrize(
    "inputs, expected",
    [
        (["1x3:float32"], "--input 1x3:float32: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x3 and 4x2)"),
        (["1x4:float32", "1x4:float32"], "TypeError: Linear.forward() takes 2 positional arguments but 3 were given"),
    ],
)
def test_inputs_the_module_rejects_are_named_before_conversion(tmp_path, capsys, inputs, expected):
    code, out, err = export_factory(capsys, tmp_path, "linear_4_to_2", *inputs)
    line = one_line_error(err)
    assert code == 1 and line.startswith("litert export: error: SOURCE 'edge_export_factories:linear_4_to_2' (Linear)")
    assert expected in line and "give one --input per forward() argument" in line
    assert "converting" not in out  # stopped before litert_torch.convert
    assert os.listdir(tmp_path) == []  # no temporary file or work folder left behind


def test_folder_without_config_is_a_bad_source(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", tmp_path, "-o", tmp_path / "m.tflite")
    assert code == 1 and "folder without config.json" in one_line_error(err)


def test_unknown_quantization(tmp_path, capsys):
    code, _, err = export_factory(capsys, tmp_path, "mlp", "4x16:float32", extra=("--quantize", "int3"))
    line = one_line_error(err)
    assert code == 1 and "unknown quantization 'int3'" in line and "dynamic-int8" in line


@pytest.mark.parametrize("spec", ["4x16", "4xax16:float32", "4x16:float33", "0x16:float32"])
def test_bad_input_spec(spec):
    with pytest.raises(ExportError) as caught:
        parse_input_spec(spec)
    assert caught.value.kind == errors.BAD_INPUT_SPEC and spec in str(caught.value)


def test_module_source_needs_inputs(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", "edge_export_factories:mlp", "-o", tmp_path / "m.tflite")
    assert code == 1 and "--input SHAPE:DTYPE" in one_line_error(err)


def test_checkpoint_without_weights_or_tokenizer(tmp_path, llama_dir):
    import shutil

    no_weights = tmp_path / "no_weights"
    shutil.copytree(llama_dir, no_weights)
    os.unlink(no_weights / "model.safetensors")
    with pytest.raises(ExportError, match="no \\*.safetensors"):
        inspect_checkpoint(str(no_weights), str(tmp_path / "stage1"))
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(llama_dir, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.unlink(no_tokenizer / name)
    with pytest.raises(ExportError, match="no tokenizer files"):
        inspect_checkpoint(str(no_tokenizer), str(tmp_path / "stage2"))


def test_leftover_gguf_quantization_config_is_staged_away(tmp_path, qwen_dir):
    import json

    checkpoint = inspect_checkpoint(qwen_dir, str(tmp_path / "staged"))
    assert checkpoint.path == str(tmp_path / "staged")
    assert "quantization_config" not in json.loads((tmp_path / "staged" / "config.json").read_text())
    assert "quantization_config" in json.loads(open(os.path.join(qwen_dir, "config.json")).read())  # untouched
    assert "quant_method=gguf" in checkpoint.notes[0]


def test_tensorflow_is_aliased_not_installed():
    from edge_export import _tf_alias

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("tensorflow")
    assert _tf_alias.install()
    from tensorflow.lite.python import schema_py_generated

    from ai_edge_litert import schema_py_generated as litert_schema

    assert schema_py_generated is litert_schema
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tensorflow.compiler.mlir.lite")


def test_console_script_prints_one_line_without_traceback(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "litert")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "edge_export.cli"]
    proc = subprocess.run(
        [*command, "export", "no/such/folder", "-o", str(tmp_path / "m.tflite")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("litert export: error: SOURCE 'no/such/folder'")


def test_help_lists_usage():
    proc = subprocess.run(
        [sys.executable, "-m", "edge_export.cli", "export", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "--prefill-lengths" in proc.stdout and "--quantize" in proc.stdout
