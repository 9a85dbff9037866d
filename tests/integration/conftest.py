from __future__ import annotations

import pytest

MLFLOW_CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": "raylm",
                      "MLFLOW_TRACKING_PASSWORD": "loopback-only-9f3c2a"}
# The server's admin account, in test_mlflow's server's environment only.
MLFLOW_ADMIN = {"MLFLOW_AUTH_ADMIN_USERNAME": "mlflow-admin",
                "MLFLOW_AUTH_ADMIN_PASSWORD": "loopback-admin-5e81d07b"}


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
    # as the cluster files arrange (test_mlflow's server makes them its tracking user).
    os.environ.update(MLFLOW_CREDENTIALS)
    # Four logical CPUs on this two-core machine: two training workers plus their readers and
    # the Train controller, which mostly wait. With the dashboard: Ray Train's placement-group
    # cleaner asks the state API whether the controller of a trial that Tune stopped is gone.
    # address="local": a new cluster, never the head another module's `ray start` recorded.
    # Metrics sent to the node's agent every 2 s rather than 10 s, so that a test's short run
    # shows in Ray's Prometheus endpoint while it trains (test_train scrapes it).
    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 2000})
    yield
    ray.shutdown()
