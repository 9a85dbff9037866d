"""A run as the driver and the Ray Train controller see it: the preflight and the dry run, what
the run places on the cluster, launching the trainer, the run's record (on the controller) and
its goodput account, MLflow, Tune sweeps and their trials, progress, benchmark evaluations
beside the run, DPO's reference pass, the run directory's lease, the cluster and job
submission. Exports and commands on a finished run are :mod:`raylm.formats`' and
:mod:`raylm.after`'s.
"""
