"""rl_tpu's touch points of torch, transformers and Ray (``rl_tpu.patches``): each record finds its names in the
installed libraries, each accessor does what the private name does, and a version outside a record's range is refused
in one line (the lean decode step turns it into its reason for standing down)."""

from __future__ import annotations

import importlib

import pytest
import torch

from rl_tpu.errors import BadInputError
from rl_tpu.patches import records
from rl_tpu.patches import record as record_module
from rl_tpu.patches import torch_internals, transformers_internals
from rl_tpu.patches.record import UnsupportedVersionError, problems


@pytest.mark.parametrize("patch", records(), ids=lambda p: p.target)
def test_record_is_complete_and_finds_its_names(patch):
    assert problems(patch) == []
    assert patch.apply is None  # rl_tpu reads these names, it replaces none
    assert patch.applied(importlib.import_module(patch.module))


@pytest.fixture
def fresh_checks(monkeypatch):
    """No record checked yet in this process, so a test's fake installed version is read."""
    monkeypatch.setattr(record_module, "_CHECKED", set())


def test_untested_torch_is_refused_in_one_line(monkeypatch, fresh_checks):
    monkeypatch.setattr(record_module, "installed_version", lambda lib: "2.14.0" if lib == "torch" else None)
    with pytest.raises(UnsupportedVersionError) as info:
        torch_internals.reorder_linear_weight(torch.randn(8, 4), 4)
    assert str(info.value) == (
        "torch 2.14.0 is outside the tested range <2.14,>=2.13 of rl-tpu's patch "
        "torch.ops.mkldnn._reorder_linear_weight + _linear_pointwise; install "
        '"torch<2.14,>=2.13"'
    )
    assert isinstance(info.value, BadInputError)
    with pytest.raises(UnsupportedVersionError):
        torch_internals.disable_current_modes()


@pytest.mark.skipif(not torch_internals.packed_linear_available(), reason="a torch build without oneDNN")
def test_onednn_packed_linear_matches_f_linear():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(24, 16), torch.randn(24), torch.randn(3, 16)
    packed = torch_internals.reorder_linear_weight(weight, 3)
    got = torch_internals.linear_pointwise(x, packed, bias)
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_dispatch_modes_are_off_inside_the_context():
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert _get_current_dispatch_mode() is not None
        with torch_internals.disable_current_modes():
            assert _get_current_dispatch_mode() is None


def _tiny_llama():
    from families import tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float().eval()


def test_rotary_function_is_the_modeling_modules_own():
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    assert (
        transformers_internals.rotary_function(model.model.layers[0].self_attn) is modeling_llama.apply_rotary_pos_emb
    )
    assert transformers_internals.rotary_function(torch.nn.Linear(2, 2)) is None  # torch's module: no RoPE there


def test_lean_step_stands_down_with_the_refusal_line_for_an_untested_transformers(monkeypatch, fresh_checks):
    from rl_tpu.sampler.lean import lean_blocker

    model = _tiny_llama()
    assert lean_blocker(model) is None
    monkeypatch.setattr(record_module, "installed_version", lambda lib: "5.11.0" if lib == "transformers" else None)
    record_module._CHECKED.clear()  # the call above checked the real one
    reason = lean_blocker(model)
    assert (
        reason is not None
        and reason.startswith("transformers 5.11.0 is outside the tested range")
        and "apply_rotary_pos_emb" in reason
        and "\n" not in reason
    )


def test_pytree_and_tensor_identity_accessors():
    a, b = torch.ones(2), torch.zeros(3)
    assert torch_internals.tree_leaves(((a, 1), {"k": b})) == [a, 1, b]
    leaves, _ = torch_internals.tree_flatten({"x": [a, b]})
    assert leaves == [a, b]
    before, key = torch_internals.version_counter(a), torch_internals.storage_key(a)
    a.add_(1)  # in place: the version grows, the storage stays
    assert torch_internals.version_counter(a) > before and torch_internals.storage_key(a) == key
    a.data = torch.ones(2)  # rebound: another storage
    assert torch_internals.storage_key(a) != key


def test_fsdp1_unwrap_reads_the_wrapper_attribute_only():
    import types

    inner = torch.nn.Linear(2, 2)
    assert torch_internals.unwrap_fsdp(types.SimpleNamespace(_fsdp_wrapped_module=inner)) is inner
    assert torch_internals.unwrap_fsdp(inner) is inner  # FSDP2 / no wrapper: the module itself


def test_dynamo_accessors():
    import torch._dynamo

    recompile, dynamo, limit_hit = torch_internals.dynamo_errors()
    assert issubclass(recompile, dynamo) and issubclass(limit_hit, Exception)
    assert callable(torch_internals.lookup_backend("eager"))
    before = torch._dynamo.config.recompile_limit
    with torch_internals.recompile_limits(3):
        assert torch._dynamo.config.recompile_limit == 3
        assert torch._dynamo.config.accumulated_recompile_limit == 6
    assert torch._dynamo.config.recompile_limit == before
    assert torch_internals.guard_failures(test_dynamo_accessors.__code__) == []  # never compiled
    assert callable(torch_internals.aot_autograd(fw_compiler=lambda gm, example_inputs: gm))

    def launch(args):
        return args

    assert torch_internals.boxed(launch) is launch and launch._boxed_call is True


def test_attn_implementation_accessors():
    from families import tiny_config

    config = tiny_config("llama")
    transformers_internals.set_attn_implementation(config, "eager")
    assert transformers_internals.attn_implementation(config) == "eager"
    transformers_internals.set_attn_implementation(config, "sdpa")
    assert transformers_internals.attn_implementation(config) == "sdpa"
    assert transformers_internals.attn_implementation(object()) is None


def test_no_split_modules_names_a_models_blocks(monkeypatch, fresh_checks):
    model = _tiny_llama()
    assert transformers_internals.no_split_modules(model) == {"LlamaDecoderLayer"}
    assert transformers_internals.no_split_modules(torch.nn.Linear(2, 2)) == set()
    monkeypatch.setattr(record_module, "installed_version", lambda lib: "5.11.0" if lib == "transformers" else None)
    record_module._CHECKED.clear()  # the calls above checked the real one
    with pytest.raises(UnsupportedVersionError, match="transformers 5.11.0 is outside the tested range"):
        transformers_internals.no_split_modules(model)


def test_op_counter_is_a_dispatch_mode_through_its_record():
    from torch.utils._python_dispatch import TorchDispatchMode

    from rl_tpu.sampler.opcount import OpCounter

    assert torch_internals.dispatch_mode_base() is TorchDispatchMode
    assert issubclass(OpCounter, TorchDispatchMode)
    with OpCounter() as counter:
        torch.ones(2).add_(1)
    assert counter.counts["add_"] == 1


def test_inductor_accessors_are_inductors_names():
    from torch._inductor import compile_fx, config, exc

    assert torch_internals.inductor_compilers() == (compile_fx.compile_fx, compile_fx.compile_fx_inner)
    dynamo_error, inductor_error = torch_internals.compile_errors()
    assert inductor_error is exc.InductorError and issubclass(dynamo_error, Exception)
    with config.patch(force_disable_caches=False):  # inductor's own patch puts the setting back (monkeypatch does not)
        torch_internals.disable_inductor_caches()
        assert config.force_disable_caches is True


def test_untested_torch_refuses_the_inductor_accessors(monkeypatch, fresh_checks):
    monkeypatch.setattr(record_module, "installed_version", lambda lib: "2.14.0" if lib == "torch" else None)
    for accessor in (
        torch_internals.inductor_compilers,
        torch_internals.compile_errors,
        torch_internals.dispatch_mode_base,
    ):
        with pytest.raises(UnsupportedVersionError):
            accessor()


def test_ray_records_are_complete_and_a_decorated_class_gives_itself_back():
    """Ray's accessors sit in ``rl_tpu/patches/`` (the shared ``verl_backend.errors`` reads the key-value store
    through them); their records are checked with VeRL's, and here without a running Ray."""
    import ray

    from rl_tpu.patches import ray_internals

    for patch in ray_internals.RECORDS:
        assert problems(patch) == [] and patch.apply is None
        assert patch.applied(importlib.import_module(patch.module)), patch.target

    class Probe:
        pass

    assert ray_internals.undecorated_class(ray.remote(Probe)) is Probe
    assert ray_internals.undecorated_class(Probe) is None  # a plain class: nothing under it


def test_untested_ray_is_refused_in_one_line(monkeypatch, fresh_checks):
    from rl_tpu.patches import ray_internals

    monkeypatch.setattr(record_module, "installed_version", lambda lib: "2.61.0" if lib == "ray" else None)
    with pytest.raises(UnsupportedVersionError) as info:
        ray_internals.kv_ready()
    assert str(info.value).startswith("ray 2.61.0 is outside the tested range") and "\n" not in str(info.value)


def test_supports_sdpa_reads_the_class_through_its_record():
    """The driver's sdpa refusal reads ``_supports_sdpa`` through the record; control: a class that says False."""
    from transformers import LlamaForCausalLM

    assert transformers_internals.supports_sdpa(LlamaForCausalLM) is True
    assert transformers_internals.supports_sdpa(type("NoSdpa", (), {"_supports_sdpa": False})) is False
    assert transformers_internals.supports_sdpa(object) is True  # says nothing: not refused
    assert transformers_internals.SUPPORTS_SDPA in transformers_internals.RECORDS
