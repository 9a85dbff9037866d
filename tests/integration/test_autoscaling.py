"""Autoscaling on one machine: Ray's AutoscalingCluster runs the real autoscaler with fake
node types that mirror cluster/aws.yaml's groups. A job (`raylm submit`) that needs 2 training
workers starts with only the head; the autoscaler adds the data node for the data work
(preparation, readers) and two training nodes for the workers, and the run completes with
every piece where its group says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
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
    from ray.cluster_utils import AutoscalingCluster

    class Cluster(AutoscalingCluster):
        # The ray wheel lacks the example config AutoscalingCluster builds its own from.
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False,
                             **settings):
            return fake_cluster_config(head_resources, worker_node_types, **settings)

        def shutdown(self):
            # `ray stop --force` kills at once, then waits for the killed processes to be
            # gone for a third of the grace period (16 s) per group of them: 12.5 s here,
            # where killed processes nobody reaps stay in the process table.
            subprocess.check_call([BIN / "ray", "stop", "--force", "--grace-period=0"])

    # The cluster is started with `ray` from this environment. Token authentication: `ray
    # start` turns it on when this user has a token, which a first local ray.init writes;
    # make one the same way if no test has yet. This process never joins the cluster: the
    # run is a submitted job and the checks run in a probe process, so no Ray state of this
    # cluster outlives the module in pytest's process.
    saved = dict(os.environ)
    os.environ["PATH"] = f"{BIN}:{os.environ['PATH']}"
    if not Path("~/.ray/auth_token").expanduser().is_file():
        subprocess.run([BIN / "ray", "get-auth-token", "--generate"], check=True,
                       capture_output=True)
    types = fake_node_types()
    # `ray start --head` serves the job API on 127.0.0.1:8265.
    cluster = Cluster(head_resources={"CPU": 1}, worker_node_types=types,
                      idle_timeout_minutes=5)
    cluster.start(override_env={"RAY_AUTH_MODE": "token"})
    yield types, {**os.environ, "RAY_AUTH_MODE": "token"}
    cluster.shutdown()
    os.environ.clear()
    os.environ.update(saved)


PROBE = """
import json, ray
from ray.util.state import list_actors, list_tasks
ray.init(address="auto", logging_level="ERROR")
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({
    "nodes": [{"id": n["NodeID"], "resources": n["Resources"]} for n in nodes],
    "workers": [a.node_id for a in list_actors(
        filters=[("class_name", "=", "RayTrainWorker")], limit=100)],
    "readers": [a.node_id for a in list_actors(limit=1000) if "_ReadBlocks" in a.class_name],
    "preparation": [t.node_id for t in list_tasks(limit=10000)
                    if t.name in ("hash_piece", "find_duplicates", "pack_piece")],
}))
"""


def probe(env) -> dict:
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_training_group_scales_up_from_zero_and_the_run_completes(autoscaling, tmp_path,
                                                                  tokenizer_dir):
    types, env = autoscaling
    assert types["gpu_train"]["min_workers"] == 0
    assert len(probe(env)["nodes"]) == 1  # the head alone

    job = subprocess.run([
        BIN / "raylm", "submit", "--address", "http://127.0.0.1:8265",
        "--config", ROOT / "jobs/configs/cpu_tiny.yaml",
        *tiny_run(tmp_path, tokenizer_dir, docs=300), "--run.name=autoscaled",
        "--train.steps=10", "--train.global_batch_size=8", "--train.micro_batch_size=4",
        "--train.log_every=5", "--train.eval_every=10", "--train.eval_batches=2",
        "--checkpoint.every=10", "--tracking.enabled=false",
        # What jobs/configs/gpu_1b_multinode.yaml asks of the cluster, on CPUs.
        "--scaling.num_workers=2", f"--scaling.worker_resources={{{TRAIN_SLOT}: 1}}",
        "--scaling.data_resources={data_node: 0.001}", "--scaling.wait_for_nodes=true",
        # An autoscaling cluster with no GPU yet: auto cannot tell, so the job says CPUs.
        "--scaling.use_gpu=false"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]

    summary = json.loads((tmp_path / "runs" / "autoscaled" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_step"] == 10
    assert summary["workers"] == 2 and summary["restarts"] == 0
    assert summary["samples"]["skipped"] == 0 and summary["samples"]["duplicated"] == 0

    seen = probe(env)
    train_nodes = {n["id"] for n in seen["nodes"] if TRAIN_SLOT in n["resources"]}
    data_nodes = {n["id"] for n in seen["nodes"] if "data_node" in n["resources"]}
    assert len(train_nodes) == 2 and len(data_nodes) == 1  # both groups grew from zero
    assert seen["workers"] and set(seen["workers"]) == train_nodes
    # The data work (the preparation's tasks, each worker's reader) ran on the data node only.
    assert seen["readers"] and set(seen["readers"]) <= data_nodes
    assert seen["preparation"] and set(seen["preparation"]) <= data_nodes
