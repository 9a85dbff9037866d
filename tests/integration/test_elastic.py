"""Elastic training on a cluster of several Ray nodes on one machine: a node is removed mid-run
and the run goes on with the worker that is left; a node is added and it grows back. A node
drained as a cloud reclaiming it would drain it: the run checkpoints at once and goes on from
there on another node."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

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



def test_node_drain_checkpoints_at_once_and_loses_no_step(cluster, tmp_path, tokenizer_dir,
                                                          monkeypatch):
    """`ray drain-node` with the preemption reason and a deadline (what a spot reclaim or the
    autoscaler sends) on the node of the run's one worker: the group saves at the step it has
    reached and stops, and a new group on the other node trains on from that checkpoint, with
    the losses of a run that was never interrupted."""
    import ray
    from ray._private.state import available_resources_per_node

    from raylm import checkpoint

    c, _ = cluster
    args = [*tiny_run(tmp_path, tokenizer_dir), "--train.global_batch_size=4",
            "--train.micro_batch_size=2", "--train.steps=40", "--train.log_every=5",
            "--train.eval_every=40", "--train.eval_batches=2", "--checkpoint.every=10",
            "--optim.lr=3e-3", "--scaling.num_workers=1",
            "--scaling.worker_resources={trainer: 1}", "--tracking.enabled=false"]
    reference = train(load_config(None, [*args, "--run.name=undrained"]), log=print)

    # Paced by Ray Train's default poll (one 5-step report per 2 s) so the drain comes
    # mid-run; drains are looked for every 0.5 s instead of 5.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    run_dir = tmp_path / "runs" / "drained"
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=train(
        load_config(None, [*args, "--run.name=drained"]), log=print)), daemon=True)
    thread.start()
    wait_for(lambda: (found := checkpoint.latest_verified(run_dir, warn=lambda m: None))
             and found[1]["state"]["step"] >= 10, "the first checkpoint")
    # The worker's node is the trainer node whose `trainer` slot is taken (a resource with
    # nothing free is left out of the node's available resources).
    free = available_resources_per_node()
    busy = [x["NodeID"] for x in ray.nodes() if x["Alive"] and x["Resources"].get("trainer")
            and free.get(x["NodeID"], {}).get("trainer", 0) == 0]
    assert len(busy) == 1, busy
    drain = subprocess.run(
        [Path(sys.executable).parent / "ray", "drain-node", "--address", c.address,
         "--node-id", busy[0], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds",
         "120"], capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    thread.join(300)
    assert "summary" in out, "the run did not finish"
    s = out["summary"]
    assert s["status"] == "finished" and s["final_step"] == 40 and s["restarts"] == 1
    (restart,) = s["interruptions"]
    assert "node drain" in restart["cause"] and "draining" in restart["cause"]
    assert restart["steps_redone"] == 0 and restart["resumed_from_step"] == restart["at_step"]
    assert 10 <= restart["at_step"] < 40
    assert s["samples"] == {"steps": 40, "trained": 160, "duplicated": 0, "skipped": 0,
                            "in_order": True}
    assert s["train_loss"] == reference["train_loss"]
    assert s["val_loss"] == reference["val_loss"]
    # The drained node is reclaimed, as its deadline says it would be.
    c.remove_node(next(n for n in c.worker_nodes if n.node_id == busy[0]))
