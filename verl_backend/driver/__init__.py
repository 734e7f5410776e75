"""What runs only in the ``verl train`` driver process: the command (:mod:`.cli`, :mod:`.train`), the backend
profiles, job planning, pre-flight checks, the memory plan, the run folder, the built-in data, running VeRL and the
run's report. Settings resolution is in :mod:`verl_backend.settings` (workers read it too). Nothing outside this
folder imports it, so no Ray worker does (``tests/test_layers.py``)."""
