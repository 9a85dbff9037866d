"""Elastic training on a cluster of several Ray nodes on one machine: a node is removed mid-run
and the run goes on with the worker that is left; a node is added and it grows back; a node
drained as a cloud reclaiming it would drain it: the run checkpoints at once and goes on from
there on the other node. One run goes through all three, since each worker group start costs
~20 s here."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raylm.config import load_config
from raylm.data.preparation import prepare
from raylm.run import record
from raylm.run.launch import train
from tests.conftest import PIECE_MB, tiny_run, write_pieces_corpus
from tests.integration import faults

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


def test_preparation_on_three_nodes_equals_one_cpu_byte_for_byte(request, tmp_path,
                                                                 tokenizer_dir):
    """The same corpus, in six preparation pieces, prepared on a 1-CPU cluster (started here,
    before this module's cluster) and on this module's three nodes: the same files, byte for
    byte."""
    import ray

    write_pieces_corpus(tmp_path / "corpus")
    cfg = load_config(None, [
        f"--data.source={tmp_path / 'corpus'}", f"--tokenizer.path={tokenizer_dir}",
        "--data.seq_len=31", "--data.rows_per_row_group=16", "--data.val_fraction=0.1",
        f"--data.piece_mb={PIECE_MB}", f"--run.cache_dir={tmp_path}/cache"])
    said: dict[str, list[str]] = {"one": [], "three": []}
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        prepare(cfg, tmp_path / "one", log=said["one"].append)
    finally:
        ray.shutdown()
    request.getfixturevalue("cluster")
    prepare(cfg, tmp_path / "three", log=said["three"].append)
    assert said["one"][-1].endswith("6 pieces packed on 1 node")
    # SPREAD is Ray's best effort: on a loaded machine a node that is busy starting a worker
    # process can be passed over, so the six pieces may land on two of the three nodes. Either
    # way the pieces were made on several nodes, which is what the bytes are compared across.
    assert said["three"][-1].endswith(("6 pieces packed on 3 nodes",
                                       "6 pieces packed on 2 nodes"))

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file()}

    one_files, three_files = files(tmp_path / "one"), files(tmp_path / "three")
    assert len(one_files) > 6 and one_files == three_files


def test_node_lost_added_back_then_drained(cluster, tmp_path, tokenizer_dir, monkeypatch):
    """Two workers, elastic between 1 and 2, on the two trainer nodes. One node is lost: the
    run goes on with the worker that is left, from its last checkpoint. A node is added: the
    run grows back to two. Then a node is drained as a cloud reclaiming it drains it (`ray
    drain-node` with the preemption reason and a deadline): the group saves at the step it has
    reached, so no step is trained twice, and goes on on the other node once the drained one
    is gone. Every sample of the seed's order is trained once, in order. (That a preempted
    group's restart ends with an uninterrupted run's losses is shown in test_train.)"""
    import ray
    from ray._private.state import available_resources_per_node


    c, nodes = cluster
    # After the node is lost, Ray Train first waits this long (60 s by default) for the
    # placement group of a group of the old size before the elastic policy settles for fewer
    # workers; a group of one is placed at once.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "4")
    # Ray Train's poll at Ray's 2 s (one pending report per worker; raylm would poll every
    # 0.5 s) paces this run at one checkpoint's report per poll (a report with a checkpoint is
    # never held back), so it is still going when the node comes back (the resize came at step
    # 40-65 of 120) and when the drain comes (step 56-78). Drains are looked for every 0.5 s
    # instead of 5.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
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
        return faults.checkpoint_step(run_dir)

    def groups():
        return [e for e in record.read(str(run_dir)) if e["event"] == "group_start"]

    wait_for(lambda: checkpoint_step() >= 5 and groups(),
             "the first checkpoint of 2 workers, and the controller to know of the group")
    c.remove_node(nodes[1])
    wait_for(lambda: [e for e in groups() if e["workers"] == 1],
             "the run to continue on 1 worker")
    c.add_node(num_cpus=1, resources={"trainer": 1})
    wait_for(lambda: len(g := groups()) >= 3 and checkpoint_step() > g[2]["from_step"],
             "a checkpoint of the group grown back to 2 workers")
    # Both trainer nodes hold a worker now (a resource with nothing free is left out of the
    # node's available resources); drain one of them.
    free = available_resources_per_node()
    busy = [x["NodeID"] for x in ray.nodes() if x["Alive"] and x["Resources"].get("trainer")
            and free.get(x["NodeID"], {}).get("trainer", 0) == 0]
    assert len(busy) == 2, busy
    drain = subprocess.run(
        [Path(sys.executable).parent / "ray", "drain-node", "--address", c.address,
         "--node-id", busy[0], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds",
         "120"], capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    # Ray Train's elastic policy still counts a draining node's resources (measured: it tried
    # groups of 2 every 4 s for minutes), so the run goes on once the node is gone, as the
    # cloud takes it at its deadline.
    wait_for(lambda: len([e for e in record.read(str(run_dir)) if e["event"] == "failure"]) >= 2,
             "the drained group to stop")
    c.remove_node(next(n for n in c.worker_nodes if n.node_id == busy[0]))
    thread.join(300)
    assert "summary" in out, "the run did not finish"
    s = out["summary"]
    assert s["status"] == "finished" and s["final_step"] == 120 and s["workers"] == 1
    shrink, grow, drained = s["interruptions"]
    assert (shrink["event"], shrink["from_workers"], shrink["to_workers"]) == ("restart", 2, 1)
    assert (grow["event"], grow["from_workers"], grow["to_workers"]) == ("resize", 1, 2)
    assert (drained["event"], drained["from_workers"], drained["to_workers"]) == (
        "restart", 2, 1)
    assert s["restarts"] == 2 and s["resizes"] == 3
    # The first group placed after the loss was of the 1 worker that fits: the elastic policy
    # saw the lost node gone at the restart (raylm's FreshClusterView), rather than asking
    # again for 2 until Ray's view of the nodes caught up.
    records = record.read(str(run_dir))
    lost_at = next(i for i, e in enumerate(records) if e["event"] == "failure")
    assert next(e for e in records[lost_at:] if e["event"] == "placing")["workers"] == 1
    for e in (shrink, grow):
        assert e["resumed_from_step"] % 5 == 0 and e["time_lost_s"] >= 0
        assert 0 <= e["steps_redone"] < 5 + 5  # at most a checkpoint interval plus a report's
    assert "node drain" in drained["cause"] and "draining" in drained["cause"]
    assert drained["steps_redone"] == 0
    assert drained["resumed_from_step"] == drained["at_step"] > grow["resumed_from_step"]
    assert s["samples"] == {"steps": 120, "trained": 960, "duplicated": 0, "skipped": 0,
                            "withheld": 0, "in_order": True, "left_out": 0}
