"""``NativeReplica``: VeRL ``RolloutReplica`` whose server is :class:`NativeRolloutServer` (no vLLM/SGLang)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.utils.device import get_device_name
from verl.workers.rollout.replica import RolloutReplica

from verl_backend.patches.verl_internals import set_replica_server  # VeRL's protected server fields
from verl_backend.rollout import server_actor_name
from verl_backend.rollout.sampling import server_env
from verl_backend.rollout.server import NativeRolloutServer


def _model_path(model_config) -> str:
    """Local HF folder of the policy: ``local_path`` on an ``HFModelConfig``, else ``path`` of the DictConfig."""
    import os

    local = getattr(model_config, "local_path", None)
    return local or os.path.expanduser(str(model_config.path))


def _checkpoint_engine_method(worker):
    """The worker's ``execute_checkpoint_engine`` actor method: ``<role>_execute_checkpoint_engine`` on a fused
    trainer worker (the prefix depends on the roles fused), plain on a standalone replica's ``CheckpointEngineWorker``
    (a rollout slice)."""
    for name in (
        "actor_rollout_ref_execute_checkpoint_engine",
        "actor_rollout_execute_checkpoint_engine",
        "rollout_execute_checkpoint_engine",
        "execute_checkpoint_engine",
    ):
        method = getattr(worker, name, None)
        if method is not None:
            return method
    raise ValueError(
        "the rollout's worker exposes no execute_checkpoint_engine method; sampler_placement=worker "
        "needs VeRL's ActorRolloutRefWorker or CheckpointEngineWorker"
    )


class NativeReplica(RolloutReplica):
    """One rollout replica = one :class:`NativeRolloutServer` actor.

    In hybrid mode (VeRL's default: trainer and rollout colocated) the server runs beside the replica's first
    trainer worker, on its node; it holds its own inference copy of the policy, refreshed after every update by
    the trainer's :class:`~verl_backend.rollout.adapter.NativeServerAdapter` through the Ray object store.
    Standalone (a rollout pool of its own: ``separate_async``, a rollout slice) it runs beside the replica's first
    ``CheckpointEngineWorker``, whose adapter receives the weights from the checkpoint engine. With
    ``sampler_placement=worker`` (the TPU profile: a process per chip) the server holds no model and forwards each
    batch to that worker, which samples on its own device: the trainer worker in hybrid mode, the
    ``CheckpointEngineWorker`` holding the rollout slice's chip standalone.
    """

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        node_id = None
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        options = {
            "name": server_actor_name(self.replica_rank, self.name_suffix),
            "max_concurrency": self.max_concurrency,
            # The server's CPU time is accounted to the trainer's bundle it shares the node with; asking for
            # a whole CPU here would deadlock small machines (2 cores) where every CPU is already reserved.
            "num_cpus": 0,
            "runtime_env": {"env_vars": server_env()},
        }
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        from verl_backend.rollout.adapter import sampler_placement

        device = get_device_name()
        worker_method = None
        if sampler_placement(self.config) == "worker":
            if not self.workers:
                raise ValueError(
                    "sampler_placement=worker needs workers holding the devices: VeRL's hybrid engine "
                    "(trainer and rollout colocated) or a standalone rollout pool"
                )
            worker_method = _checkpoint_engine_method(self.workers[0])
        server = (
            ray.remote(NativeRolloutServer)
            .options(**options)
            .remote(
                rollout_config=self.config,
                model_path=_model_path(self.model_config),
                device=device,
                replica_rank=self.replica_rank,
                trust_remote_code=bool(getattr(self.model_config, "trust_remote_code", False) or False),
                worker_method=worker_method,
            )
        )
        self.servers = [server]
        ip, _ = await server.get_server_address.remote()
        set_replica_server(self, server, f"native://{ip}/replica-{self.replica_rank}{self.name_suffix}")
