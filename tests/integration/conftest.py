from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module (starting one takes ~10 s here)."""
    import ray

    # Four logical CPUs on this two-core machine: two training workers plus their readers and
    # the Train controller, which mostly wait.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
