"""FSDP2's private names, read only in ``verl_backend/patches/fsdp2_internals.py``: present in the installed torch on
a real ``fully_shard`` module (one gloo rank), and refused in one line for a torch they were not checked with."""

import multiprocessing as mp
import socket

import pytest

from rl_tpu.shared_weights import SharedWeightsError
from verl_backend.patches import fsdp2_internals as fsdp2


def _one_rank(port: int, conn) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    found = fsdp2.fsdp_params(model)
    params = list(model.parameters())
    out = {
        "all_found": sorted(found) == sorted(id(p) for p in params),
        "whole": all(fsdp2.is_whole(fp) for fp in found.values()),
        "shapes": sorted(fsdp2.shapes(fp)[0] for fp in found.values()),
        "same_values": all(torch.equal(fsdp2.local_storage(fp), fp.sharded_param.to_local()) for fp in found.values()),
    }
    # rebind every parameter onto new storage: the optimizer's step lands there, the forward reads it
    fresh = {}
    for key, fp in found.items():
        view = fsdp2.local_storage(fp).clone()
        fsdp2.rebind(fp, view)
        fresh[key] = view
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    model(x).square().sum().backward()
    before = {k: v.clone() for k, v in fresh.items()}
    opt.step()
    out["step_lands_in_new_storage"] = all(not torch.equal(before[k], fresh[k]) for k in fresh)
    out["params_kept"] = all(a is b for a, b in zip(params, model.parameters()))
    with torch.no_grad():
        fresh[id(params[0])].zero_()  # the first layer's weight, through the new storage only
        y = model(x)
        want = model[1](params[1].full_tensor().expand(3, 16))  # layer 0 gives its bias alone
    out["forward_reads_new_storage"] = torch.allclose(y, want)
    out["plain_module"] = fsdp2.fsdp_params(torch.nn.Linear(2, 2))
    dist.destroy_process_group()
    conn.send(out)


def test_private_names_work_on_a_real_fully_shard_module():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_one_rank, args=(port, child))
    proc.start()
    out = parent.recv() if parent.poll(180) else None
    proc.join(60)
    assert out is not None and proc.exitcode == 0
    assert out["all_found"] and out["whole"] and out["same_values"]
    assert out["shapes"] == [(4,), (4, 16), (16,), (16, 8)]
    assert out["step_lands_in_new_storage"] and out["params_kept"]
    assert out["forward_reads_new_storage"], "the all-gather must read the rebound storage"
    assert out["plain_module"] == {}


@pytest.mark.parametrize("version", ["2.14.0", "2.12.1", "3.0.0"])
def test_an_unchecked_torch_is_refused_in_one_line(version):
    with pytest.raises(SharedWeightsError, match=rf"torch {version} is installed; the weights go through the object"):
        fsdp2.check_torch(version)


def test_the_installed_torch_is_in_range():
    fsdp2.check_torch()  # 2.13.0+cpu here: a local version label is not a different release
    fsdp2.check_torch("2.13.0+cpu")
