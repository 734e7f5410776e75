"""What every VeRL process loads: the plugin VeRL imports through its ``verl.plugins`` entry point (driver, TaskRunner,
trainer workers, rollout servers, agent and reward loops) and what it registers or hooks there.

- :mod:`.plugin` the entry point: platforms, engine, rollout and checkpoint engines registered, patches applied;
- :mod:`.platforms` the ``cpu`` and ``tpu`` platforms;
- :mod:`.engine` the FSDP2 training engine for ``cpu``/``tpu`` (trainer workers), with its fast paths
  :mod:`.response_logits` and :mod:`.shared_prefix`;
- :mod:`.slice_pool` VeRL's resource pools reserved as one TPU slice (the TaskRunner);
- :mod:`.preemption` SIGTERM: the step-boundary hook of the process that runs VeRL's trainer loop (the TaskRunner; in
  the ``verl train`` process by default, which installs it).

Imports go down only: nothing here imports :mod:`verl_backend.driver` (``tests/test_layers.py``).
"""
