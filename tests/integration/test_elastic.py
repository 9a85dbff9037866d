"""Elastic training on a cluster of several Ray nodes on one machine: a node is removed mid-run
and the run goes on with the worker that is left; a node is added and it grows back."""

from __future__ import annotations

import threading
import time

import pytest

from raylm import record
from raylm.config import load_config
from raylm.launch import train
from tests.conftest import tiny_run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    """A head (controller, data readers) and two 1-CPU nodes that each hold one training
    worker: the workers ask for the custom resource `trainer` that only those nodes have."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = [c.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def wait_for(predicate, what: str, timeout: float = 180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_node_lost_then_added_back(cluster, tmp_path, tokenizer_dir, monkeypatch):
    from raylm import checkpoint

    c, nodes = cluster
    # After the node is lost, Ray Train first waits this long (60 s by default) for the
    # placement group of a group of the old size before the elastic policy settles for fewer
    # workers; a group of one is placed at once.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    # Ray Train's default poll (every 2 s, one pending report per worker) paces this run at
    # one 5-step report per poll, so it is still going when the node comes back (the resize
    # came at step 20-30 of 120); the suite's faster poll would finish it on one worker first.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    cfg = load_config(None, [
        *tiny_run(tmp_path, tokenizer_dir), "--run.name=elastic",
        "--train.global_batch_size=8", "--train.micro_batch_size=2",
        "--train.steps=120", "--train.log_every=5", "--train.eval_every=100",
        "--train.eval_batches=2", "--checkpoint.every=5", "--optim.lr=3e-3",
        "--scaling.num_workers=[1,2]", "--scaling.worker_resources={trainer: 1}",
        "--scaling.resize_interval_s=2", "--tracking.enabled=false"])
    run_dir = tmp_path / "runs" / "elastic"
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=train(cfg, log=print)),
                              daemon=True)
    thread.start()

    def checkpoint_step():
        found = checkpoint.latest_verified(run_dir, warn=lambda m: None)
        return found[1]["state"]["step"] if found else 0

    wait_for(lambda: checkpoint_step() >= 5 and [
        e for e in record.read(str(run_dir)) if e["event"] == "group_start"],
        "the first checkpoint of 2 workers, and the controller to know of the group")
    c.remove_node(nodes[1])
    wait_for(lambda: [e for e in record.read(str(run_dir)) if e["event"] == "group_start"
                      and e["workers"] == 1], "the run to continue on 1 worker")
    c.add_node(num_cpus=1, resources={"trainer": 1})
    thread.join(300)
    assert "summary" in out, "the run did not finish"
    s = out["summary"]
    assert s["status"] == "finished" and s["final_step"] == 120 and s["workers"] == 2
    shrink, grow = s["interruptions"]
    assert (shrink["event"], shrink["from_workers"], shrink["to_workers"]) == ("restart", 2, 1)
    assert (grow["event"], grow["from_workers"], grow["to_workers"]) == ("resize", 1, 2)
    assert s["restarts"] == 1 and s["resizes"] == 2
    for e in (shrink, grow):
        assert e["resumed_from_step"] % 5 == 0 and e["time_lost_s"] >= 0
        assert 0 <= e["steps_redone"] < 5 + 5  # at most a checkpoint interval plus a report's
    assert s["samples"] == {"steps": 120, "trained": 960, "duplicated": 0, "skipped": 0,
                            "in_order": True}
