"""Autoscaling on one machine: Ray's AutoscalingCluster runs the real autoscaler with fake
node types that mirror cluster/aws.yaml's groups. A run that needs 2 training workers starts
with only the head; the autoscaler adds the data node for Ray Data work and two training nodes
for the workers, and the run completes with every piece where its group says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylm.config import load_config
from raylm.launch import train
from tests.conftest import make_docs, write_jsonl

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# CPU stand-in for the GPU group: training workers ask for one of these instead of a GPU.
TRAIN_SLOT = "fake_gpu"


def fake_node_types() -> dict[str, dict]:
    """cluster/aws.yaml's worker groups, small: same names and custom resources, min 0,
    1-2 CPU nodes; the GPU group offers TRAIN_SLOT in place of GPUs."""
    groups = yaml.safe_load((ROOT / "cluster/aws.yaml").read_text())["available_node_types"]
    out = {}
    for name, group in groups.items():
        if name == "head":
            continue
        custom = dict(group["resources"])
        resources = ({"CPU": 1, TRAIN_SLOT: 1} if name == "gpu_train"
                     else {"CPU": 2, **custom})
        out[name] = {"resources": resources, "node_config": {}, "min_workers": 0,
                     "max_workers": min(group["max_workers"], 2)}
    return out


def fake_cluster_config(head_resources: dict, node_types: dict, **settings) -> dict:
    """An autoscaler config for Ray's fake multi-node provider (nodes are local raylets)."""
    return {
        "cluster_name": "raylm-fake",
        "max_workers": sum(t["max_workers"] for t in node_types.values()),
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {**node_types, "ray.head.default": {
            "resources": head_resources, "node_config": {}, "max_workers": 0}},
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands",
                           "worker_start_ray_commands")},
        **settings,
    }


@pytest.fixture(scope="module")
def autoscaling():
    import ray
    from ray.cluster_utils import AutoscalingCluster

    class Cluster(AutoscalingCluster):
        # The ray wheel lacks the example config AutoscalingCluster builds its own from.
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False,
                             **settings):
            return fake_cluster_config(head_resources, worker_node_types, **settings)

    # The cluster is started with `ray` from this environment. Token authentication: `ray
    # start` turns it on when this user has a token, which a first local ray.init writes;
    # make one the same way if no test has yet.
    saved = dict(os.environ)
    bin_dir = Path(sys.executable).parent
    os.environ["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    if not Path("~/.ray/auth_token").expanduser().is_file():
        subprocess.run([bin_dir / "ray", "get-auth-token", "--generate"], check=True,
                       capture_output=True)
    types = fake_node_types()
    cluster = Cluster(head_resources={"CPU": 1}, worker_node_types=types,
                      idle_timeout_minutes=5)
    cluster.start()
    ray.init(address="auto", log_to_driver=False)
    yield types
    ray.shutdown()
    cluster.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def test_training_group_scales_up_from_zero_and_the_run_completes(autoscaling, tmp_path,
                                                                  tokenizer_dir):
    from ray.util.state import list_actors, list_tasks

    assert autoscaling["gpu_train"]["min_workers"] == 0
    assert len(alive_nodes()) == 1  # the head alone

    write_jsonl(tmp_path / "corpus.jsonl", make_docs(300))
    cfg = load_config(str(ROOT / "jobs/configs/cpu_tiny.yaml"), [
        f"--data.source={tmp_path / 'corpus.jsonl'}", f"--tokenizer.path={tokenizer_dir}",
        "--data.seq_len=32", "--data.val_fraction=0.1", f"--run.cache_dir={tmp_path}/cache",
        f"--run.storage_path={tmp_path}/runs", "--run.name=autoscaled",
        "--train.steps=10", "--train.global_batch_size=8", "--train.micro_batch_size=4",
        "--train.log_every=5", "--train.eval_every=10", "--train.eval_batches=2",
        "--checkpoint.every=10", "--tracking.enabled=false",
        # What jobs/configs/gpu_1b_multinode.yaml asks of the cluster, on CPUs.
        "--scaling.num_workers=2", f"--scaling.worker_resources={{{TRAIN_SLOT}: 1}}",
        "--scaling.data_resources={data_node: 0.001}", "--scaling.wait_for_nodes=true"])
    summary = train(cfg, log=print)

    assert summary["status"] == "finished" and summary["final_step"] == 10
    assert summary["workers"] == 2 and summary["restarts"] == 0
    assert summary["samples"]["skipped"] == 0 and summary["samples"]["duplicated"] == 0

    nodes = alive_nodes()
    train_nodes = {n["NodeID"] for n in nodes if TRAIN_SLOT in n["Resources"]}
    data_nodes = {n["NodeID"] for n in nodes if "data_node" in n["Resources"]}
    assert len(train_nodes) == 2 and len(data_nodes) == 1  # both groups grew from zero
    workers = list_actors(filters=[("class_name", "=", "RayTrainWorker")], limit=100)
    assert workers and {a.node_id for a in workers} == train_nodes
    # Ray Data's work (tokenizing in prepare, each worker's reader) ran on the data node only.
    readers = [a for a in list_actors(limit=1000) if "_ReadBlocks" in a.class_name]
    assert readers and {a.node_id for a in readers} <= data_nodes
    tokenize = [t for t in list_tasks(limit=10000) if "_read_and_tokenize" in t.name]
    assert tokenize and {t.node_id for t in tokenize} <= data_nodes
