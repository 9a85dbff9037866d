from __future__ import annotations

import pytest

MLFLOW_CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": "raylm",
                      "MLFLOW_TRACKING_PASSWORD": "loopback-only-9f3c2a"}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every module that needs a plain one (starting one takes ~10 s
    here); the modules that need another shape (several nodes, an autoscaler, a job server)
    run before these (pytest takes modules in name order: autoscaling, elastic, jobs, then
    mlflow, notebooks, pipeline, sft, train, tune), in their own processes, and shut down only
    what they started."""
    import os

    import ray

    # Every process of the cluster holds the MLflow server's credentials in its environment,
    # as the cluster files arrange (test_mlflow's server takes these as its admin account).
    os.environ.update(MLFLOW_CREDENTIALS)
    # Four logical CPUs on this two-core machine: two training workers plus their readers and
    # the Train controller, which mostly wait. With the dashboard: Ray Train's placement-group
    # cleaner asks the state API whether the controller of a trial that Tune stopped is gone.
    # address="local": a new cluster, never the head another module's `ray start` recorded.
    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=False)
    yield
    ray.shutdown()
