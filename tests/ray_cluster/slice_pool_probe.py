"""Run by ``test_verl_slice_pool.py`` in its own process (the VeRL platform is chosen per process):
VeRL's own ``ResourcePoolManager`` and ``RayWorkerGroup`` on the fake slice, through the rl-tpu plugin.

    RAY_ADDRESS=... VERL_PLATFORM=tpu RL_TPU_SETTINGS='{"slice": "v4-16", ...}' python slice_pool_probe.py HOSTS CHIPS

Prints one JSON line: the pool class VeRL got and what every worker saw, or the error it raised.
"""

import json
import os
import sys

import ray
import verl  # noqa: F401  (loads the rl-tpu plugin: platforms and patches)
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager


class ProbeWorker(Worker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def where(self):
        ctx = ray.get_runtime_context()
        return {
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
            "master_addr": os.environ["MASTER_ADDR"],
            "node_id": ctx.get_node_id(),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID"),
            "tpu_name": os.environ.get("TPU_NAME"),
            "chips": ctx.get_accelerator_ids().get("TPU", []),
            "visible_chips": os.environ.get("TPU_VISIBLE_CHIPS"),
        }


def main() -> None:
    hosts, chips = (int(x) for x in sys.argv[1:3])
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    mgr = ResourcePoolManager(resource_pool_spec={"global_pool": [chips] * hosts}, mapping={"actor": "global_pool"})
    mgr.create_resource_pool()
    pool = mgr.get_resource_pool("actor")
    out = {"pool": type(pool).__name__}
    if out["pool"] == "SliceResourcePool" or os.environ.get("PROBE_WORKERS") == "1":
        try:
            wg = RayWorkerGroup(
                resource_pool=pool,
                device_name="tpu",
                ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ProbeWorker)),
            )
            out["workers"] = wg.where()
            out["bundle_hosts"] = pool.placement.bundle_hosts()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
