"""A run as the driver and the Ray Train controller see it: launching the trainer, the run's
record (on the controller), MLflow, Tune sweeps, progress, the cluster, job submission, and
export and generation after training.
"""
