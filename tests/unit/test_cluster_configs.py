"""The cluster launcher YAMLs, the KubeRay manifests and the job configs, checked with Ray's own
autoscaler code: defaults filled in and validated against the schema shipped in the ray
package, and the KubeRay RayCluster translated as KubeRay's autoscaler translates it."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config

from raylm.config import batch_plan, load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ["cluster/aws.yaml", "cluster/gcp.yaml"]
JOB_CONFIGS = sorted(p.name for p in (ROOT / "jobs" / "configs").glob("*.yaml"))


def launcher(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def ray_cluster() -> dict:
    docs = yaml.safe_load_all((ROOT / "cluster/kuberay/raycluster.yaml").read_text())
    return next(d for d in docs if d["kind"] == "RayCluster")


def groups_of(prepared: dict) -> dict[str, dict]:
    return {k: v for k, v in prepared["available_node_types"].items()
            if k != prepared["head_node_type"]}


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_yaml_passes_rays_validation(name):
    prepared = prepare_config(launcher(name))
    validate_config(prepared)

    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert not head["resources"].get("GPU") and head["max_workers"] == 0
    groups = groups_of(prepared)
    assert sorted(groups) == ["cpu_data", "gpu_train"]
    # Only the data group advertises data_node; both groups autoscale from zero.
    assert [n for n, g in groups.items() if "data_node" in g["resources"]] == ["cpu_data"]
    assert all(g["min_workers"] == 0 < g["max_workers"] for g in groups.values())
    # The job server listens on loopback (reached through `ray dashboard`), token auth on.
    start = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "RAY_AUTH_MODE=token" in start
    assert "RAY_AUTH_MODE=token" in " ".join(prepared["worker_start_ray_commands"])
    assert "~/.ray/auth_token" in prepared["file_mounts"]
    assert any("pip install" in c and "raylm" in c for c in prepared["setup_commands"])


@pytest.mark.parametrize("name", LAUNCHER)
def test_rays_validation_rejects_a_broken_copy(name):
    broken = launcher(name)
    group = next(iter(groups_of(prepare_config(launcher(name)))))
    broken["available_node_types"][group]["min_worker"] = 0  # misspelled key
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        validate_config(prepare_config(broken))


def test_kuberay_cluster_translates_and_validates():
    cr = ray_cluster()
    config = _derive_autoscaling_config_from_ray_cr(copy.deepcopy(cr))  # validates, too
    validate_config(config)
    types = config["available_node_types"]
    assert types["gpu-train"]["resources"]["GPU"] == 8
    assert types["gpu-train"]["min_workers"] == 0 < types["gpu-train"]["max_workers"]
    assert types["cpu-data"]["resources"]["data_node"] == 1000
    assert types["cpu-data"]["min_workers"] == 0 < types["cpu-data"]["max_workers"]
    assert "GPU" not in types["headgroup"]["resources"]
    assert cr["spec"]["enableInTreeAutoscaling"] is True


def test_kuberay_job_runs_on_the_same_cluster_spec_and_nothing_is_public():
    job = yaml.safe_load((ROOT / "cluster/kuberay/rayjob.yaml").read_text())
    assert job["kind"] == "RayJob"
    assert job["spec"]["rayClusterSpec"] == ray_cluster()["spec"]
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["python", "jobs/pretrain.py"]
    assert (ROOT / entry[entry.index("--config") + 1]).is_file()
    for doc in yaml.safe_load_all((ROOT / "cluster/kuberay/raycluster.yaml").read_text()):
        if doc["kind"] == "Service":
            assert doc["spec"]["type"] == "ClusterIP"
        assert doc["kind"] != "Ingress"


@pytest.mark.parametrize("name", JOB_CONFIGS)
def test_job_configs_load_and_fit_their_batches(name):
    cfg = load_config(str(ROOT / "jobs" / "configs" / name), [])
    lo, hi = cfg.scaling.worker_range
    for workers in range(lo, hi + 1):
        micro, accum = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                  workers)
        assert micro * accum * workers == cfg.train.global_batch_size
    # Data work asks only for resources that a data group advertises, in every cluster file.
    for res in cfg.scaling.data_resources:
        for prepared in [prepare_config(launcher(n)) for n in LAUNCHER] + [
                _derive_autoscaling_config_from_ray_cr(ray_cluster())]:
            assert any(res in g["resources"] and not g["resources"].get("GPU")
                       for g in groups_of(prepared).values())
    if cfg.scaling.use_gpu:
        assert cfg.train.precision in ("auto", "bf16-mixed", "bf16-true")
    if cfg.scaling.use_gpu and hi > 1:
        # Every node must reach the run and the data: object storage or the shared mount (a
        # one-GPU config, gpu_1b_one.yaml, runs on the machine that holds the GPU).
        assert cfg.run.storage_path.startswith(("s3://", "gs://", "/mnt/raylm/"))
        assert cfg.run.cache_dir.startswith("/mnt/raylm/")


@pytest.mark.parametrize("name", ["pretrain.py", "prepare.py", "sweep.py"])
def test_entrypoints_show_their_commands(name):
    text = (ROOT / "jobs" / name).read_text()
    assert f"python jobs/{name}" in text and "ray job submit --working-dir ." in text
