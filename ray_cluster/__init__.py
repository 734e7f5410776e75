"""TPU slices on Ray: slice placement (``placement``), a local fake-slice cluster (``fake_slice``),
job submission (``jobs``), KubeRay manifests (``kuberay``) and the ``rl-tpu`` CLI (``cli``).

Builds on ``rl_tpu.topology``; imports nothing else of ours.
"""
