"""What runs only in the ``verl train`` driver process: settings resolution is in :mod:`verl_backend.settings`
(workers read it too); here are the backend profiles, job planning, pre-flight checks, the run folder, the built-in
data and running VeRL. Nothing here is imported by a Ray worker."""
