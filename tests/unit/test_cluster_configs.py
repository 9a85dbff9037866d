"""The cluster launcher YAMLs, the KubeRay manifests and the job configs, checked with Ray's own
autoscaler code: defaults filled in and validated against the schema shipped in the ray
package, and the KubeRay RayCluster translated as KubeRay's autoscaler translates it."""

from __future__ import annotations

import copy
import re
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
    assert sorted(groups) == ["cpu_data", "gpu_eval", "gpu_train"]
    # Only the data group advertises data_node, only the evaluation group eval_node (and too
    # few CPUs for any training worker of jobs/configs); every group autoscales from zero.
    assert [n for n, g in groups.items() if "data_node" in g["resources"]] == ["cpu_data"]
    assert [n for n, g in groups.items() if "eval_node" in g["resources"]] == ["gpu_eval"]
    assert groups["gpu_eval"]["resources"]["CPU"] < 4
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
    assert types["gpu-eval"]["resources"]["eval_node"] == 1
    assert types["gpu-eval"]["resources"]["CPU"] < 4 and types["gpu-eval"]["resources"]["GPU"] == 1
    assert "GPU" not in types["headgroup"]["resources"]
    assert cr["spec"]["enableInTreeAutoscaling"] is True


def test_kuberay_job_runs_on_the_same_cluster_spec_and_nothing_is_public():
    job = yaml.safe_load((ROOT / "cluster/kuberay/rayjob.yaml").read_text())
    assert job["kind"] == "RayJob"
    # The same cluster, but for the training group's size, which Kueue admits at once.
    spec, same = copy.deepcopy(job["spec"]["rayClusterSpec"]), ray_cluster()["spec"]
    for group in (spec, same):
        train = group["workerGroupSpecs"][0]
        assert train["groupName"] == "gpu-train"
        for key in ("replicas", "minReplicas", "maxReplicas"):
            train.pop(key)
    assert spec == same
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
    if cfg.scaling.use_gpu is True:
        assert cfg.train.precision in ("auto", "bf16-mixed", "bf16-true")
    if cfg.scaling.use_gpu is True and hi > 1:
        # Every node must reach the run and the data: object storage or the shared mount (a
        # one-GPU config, gpu_1b_one.yaml, runs on the machine that holds the GPU).
        assert cfg.run.storage_path.startswith(("s3://", "gs://", "/mnt/raylm/"))
        assert cfg.run.cache_dir.startswith("/mnt/raylm/")


@pytest.mark.parametrize("name", ["pretrain.py", "prepare.py", "sweep.py"])
def test_entrypoints_show_their_commands(name):
    text = (ROOT / "jobs" / name).read_text()
    assert f"python jobs/{name}" in text and "ray job submit --working-dir ." in text


def kuberay_docs() -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "cluster/kuberay/raycluster.yaml").read_text()))


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec["containers"]


def secret_env(container: dict) -> dict[str, tuple[str, str]]:
    """The container's variables set from a Secret: name -> (secret, key)."""
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    return {name: (ref["name"], ref["key"]) for name, ref in refs.items()}


def test_cluster_files_are_closed_by_default():
    """Authentication everywhere, MLflow answering only to the names the cluster uses, one
    writer of its store, no world-writable directory, credentials never in a file here."""
    files = {p.relative_to(ROOT).as_posix(): p.read_text()
             for p in sorted((ROOT / "cluster").rglob("*")) if p.is_file()}
    for name, text in files.items():
        assert "chmod 777" not in text and "a+w" not in text and "0777" not in text, name
        # The server starts only through the script that closes it.
        if name != "cluster/mlflow.sh":
            assert "mlflow server" not in text, name
        assert not re.search(r"PASSWORD\s*[=:]\s*[\"']?\w{4,}", text), f"{name} holds a password"
    script = files["cluster/mlflow.sh"]
    for flag in ("--app-name basic-auth", "--allowed-hosts", "--workers 1",
                 "default_permission = NO_PERMISSIONS"):
        assert flag in script, flag

    # Launcher files: the credentials file is mounted, read by every `ray start` and by the
    # server's start, and the server runs through the script.
    for name in LAUNCHER:
        cfg = launcher(name)
        assert cfg["file_mounts"]["~/.raylm/mlflow.env"] == "~/.raylm/mlflow.env"
        head = cfg["head_start_ray_commands"]
        (server,) = [c for c in head if "cluster/mlflow.sh" in c]
        assert "MLFLOW_ALLOWED_HOSTS=" in server and ". ~/.raylm/mlflow.env" in server
        # The admin account: made on the head under umask 077, read by the server alone.
        (made,) = [c for c in head if "mlflow-admin.env" in c and c != server]
        assert "umask 077" in made and "openssl rand" in made
        assert ". ~/.raylm/mlflow-admin.env" in server
        assert "mlflow-admin" not in str(cfg["file_mounts"])
        for c in [*head, *cfg["worker_start_ray_commands"]]:
            if "ray start" in c:
                assert ". ~/.raylm/mlflow.env" in c and "RAY_AUTH_MODE=token" in c
                assert "mlflow-admin" not in c
        assert any("[gpu,server,eval]" in c for c in cfg["setup_commands"])

    # KubeRay: token auth by the operator, the server behind basic auth with its service's
    # names allowed, credentials from Secrets, one writer (Recreate, one replica, its own
    # volume), network policies that admit only the cluster's pods.
    docs = kuberay_docs()
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    cluster = by_kind["RayCluster"][0]
    assert cluster["spec"]["authOptions"]["mode"] == "token"
    (deployment,) = by_kind["Deployment"]
    (service,) = by_kind["Service"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (mlflow,) = containers(deployment["spec"]["template"]["spec"])
    assert mlflow["command"][:2] == ["bash", "cluster/mlflow.sh"]
    allowed = next(e["value"] for e in mlflow["env"] if e["name"] == "MLFLOW_ALLOWED_HOSTS")
    port = service["spec"]["ports"][0]["port"]
    assert f"{service['metadata']['name']}:{port}" in allowed.split(",")
    credentials = {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    admin = {"MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD"}
    assert credentials | admin <= set(secret_env(mlflow))
    store_claim = deployment["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    claim = next(d for d in by_kind["PersistentVolumeClaim"]
                 if d["metadata"]["name"] == store_claim["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    tracking_uri = f"http://{service['metadata']['name']}:{port}"
    pods = [cluster["spec"]["headGroupSpec"]["template"],
            *(g["template"] for g in cluster["spec"]["workerGroupSpecs"])]
    member = {"app.kubernetes.io/part-of": "raylm"}
    for pod in pods:
        assert member.items() <= pod["metadata"]["labels"].items()
        for c in containers(pod["spec"]):
            assert credentials <= set(secret_env(c)) and not admin & set(secret_env(c))
            assert {"name": "MLFLOW_TRACKING_URI", "value": tracking_uri} in c["env"]
    policies = {tuple(sorted(p["spec"]["podSelector"]["matchLabels"].items())): p
                for p in by_kind["NetworkPolicy"]}
    for selected in ({"app": "raylm-mlflow"}, member):
        policy = policies[tuple(sorted(selected.items()))]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        members, *others = policy["spec"]["ingress"]
        assert [f["podSelector"]["matchLabels"] for f in members["from"]] == [member]
        if selected == member:
            # The KubeRay operator polls a RayJob's status on the head's dashboard: admitted
            # there, from its own namespace, and nowhere else.
            # Prometheus scrapes the metrics port, from its own namespace.
            operator, prometheus = others
            for rule, name, port in ((operator, "kuberay-operator", 8265),
                                     (prometheus, "prometheus", 8080)):
                (source,) = rule["from"]
                assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
                assert "kubernetes.io/metadata.name" in source["namespaceSelector"]["matchLabels"]
                assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
        else:
            assert others == []
    job = yaml.safe_load((ROOT / "cluster/kuberay/rayjob.yaml").read_text())
    assert job["spec"]["submissionMode"] == "SidecarMode"  # the submitter is a member pod

    # A local head: token auth whatever the caller's environment says.
    assert "export RAY_AUTH_MODE=token" in files["cluster/local.sh"]


@pytest.mark.parametrize("name", JOB_CONFIGS)
def test_job_configs_restart_a_bounded_number_of_times(name):
    cfg = load_config(str(ROOT / "jobs" / "configs" / name), [])
    assert 0 <= cfg.train.max_failures <= 100
    assert 1 <= cfg.train.max_failures_at_one_step <= 10


def test_mlflow_credentials_travel_to_a_joined_cluster_but_not_into_a_submitted_job():
    from raylm.run.cluster import forwarded_env

    env = {"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p",
           "MLFLOW_TRACKING_URI": "http://h:5000", "AWS_SECRET_ACCESS_KEY": "x"}
    assert forwarded_env(env) == {"MLFLOW_TRACKING_USERNAME": "u",
                                  "MLFLOW_TRACKING_PASSWORD": "p"}
    assert forwarded_env({**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}) == {}


def test_credentials_the_nodes_already_have_are_not_forwarded():
    """Forwarded credentials land in Ray's job record and the nodes' logs: only those the
    nodes lack, or hold with another value, travel with the job."""
    from raylm.run.cluster import _digest, missing_on_nodes

    wanted = {"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p"}
    assert missing_on_nodes(wanted, {k: _digest(v) for k, v in wanted.items()}) == {}
    assert missing_on_nodes(wanted, {"MLFLOW_TRACKING_USERNAME": _digest("u"),
                                     "MLFLOW_TRACKING_PASSWORD": None}) == {
        "MLFLOW_TRACKING_PASSWORD": "p"}
    assert missing_on_nodes(wanted, {"MLFLOW_TRACKING_USERNAME": _digest("other"),
                                     "MLFLOW_TRACKING_PASSWORD": _digest("p")}) == {
        "MLFLOW_TRACKING_USERNAME": "u"}


ADMIN = {"MLFLOW_AUTH_ADMIN_USERNAME": "admin", "MLFLOW_AUTH_ADMIN_PASSWORD": "an-admin-password"}


@pytest.mark.parametrize(("env", "says"), [
    ({}, "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD must be set"),
    ({"MLFLOW_TRACKING_USERNAME": "raylm", "MLFLOW_TRACKING_PASSWORD": "short"},
     "shorter than 12"),
    ({"MLFLOW_TRACKING_USERNAME": "raylm", "MLFLOW_TRACKING_PASSWORD": "a-long-password"},
     "MLFLOW_AUTH_ADMIN_USERNAME and MLFLOW_AUTH_ADMIN_PASSWORD must be set"),
    ({"MLFLOW_TRACKING_USERNAME": "raylm", "MLFLOW_TRACKING_PASSWORD": "a-long-password",
      "MLFLOW_AUTH_ADMIN_USERNAME": "raylm", "MLFLOW_AUTH_ADMIN_PASSWORD": "another-long-one"},
     "MLFLOW_TRACKING_USERNAME is the admin's name"),
    ({**ADMIN, "MLFLOW_TRACKING_USERNAME": "raylm", "MLFLOW_TRACKING_PASSWORD": "a-long-password"},
     "MLFLOW_ALLOWED_HOSTS must name"),
    ({**ADMIN, "MLFLOW_TRACKING_USERNAME": "raylm", "MLFLOW_TRACKING_PASSWORD": "a-long-password",
      "MLFLOW_ALLOWED_HOSTS": "raylm-mlflow:5000,*"}, "would answer any Host header"),
])
def test_the_mlflow_script_refuses_to_start_open(env, says):
    import subprocess

    out = subprocess.run(
        ["bash", str(ROOT / "cluster/mlflow.sh"), "--store", "sqlite:////tmp/x/mlflow.db",
         "--artifacts", "/tmp/x/artifacts"],
        env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_ssh_is_not_open_to_the_internet_and_hub_downloads_land_on_shared_storage():
    """Ray's AWS launcher opens SSH to 0.0.0.0/0 in the security group it makes when no node
    names one of its own; GCP's default network does the same. Every node downloads hub
    models and data sets into one cache on the shared file system (HF_HOME)."""
    aws = launcher("cluster/aws.yaml")
    for name, node in aws["available_node_types"].items():
        assert node["node_config"]["SecurityGroupIds"], name
    assert "firewall-rules update default-allow-ssh" in (ROOT / "cluster/gcp.yaml").read_text()
    for name in LAUNCHER:
        cfg = launcher(name)
        for c in [*cfg["head_start_ray_commands"], *cfg["worker_start_ray_commands"]]:
            if "ray start" in c:
                assert "HF_HOME=/mnt/raylm/hf" in c, name
    cluster = ray_cluster()
    for pod in [cluster["spec"]["headGroupSpec"]["template"],
                *(g["template"] for g in cluster["spec"]["workerGroupSpecs"])]:
        for c in containers(pod["spec"]):
            assert {"name": "HF_HOME", "value": "/mnt/raylm/hf"} in c["env"]


def test_submitting_over_plain_http_to_another_machine_is_warned():
    from raylm.run.submit import in_clear

    assert "plain HTTP to another machine" in in_clear("http://10.0.0.5:8265")
    for fine in ("http://127.0.0.1:8265", "http://localhost:8265", "http://[::1]:8265",
                 "https://ray.example.com"):
        assert in_clear(fine) is None, fine


# --------------------------------------------------------------------------------------------
# Kubernetes manifests against the schemas of the operators they are written for, vendored in
# tests/schemas (its README names the releases). Checked strictly, as `kubectl apply
# --validate=strict` checks: a field the schema does not know is an error, not pruned.
# --------------------------------------------------------------------------------------------

SCHEMAS = ROOT / "tests" / "schemas"


def strict(schema: dict) -> dict:
    """``schema`` with every object that lists its properties closed to others (unless it
    keeps unknown fields on purpose)."""
    schema = dict(schema)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    for key in ("properties", "patternProperties"):
        if key in schema:
            schema[key] = {k: strict(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [strict(v) for v in schema[key]]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict schema, for every served version of every CRD."""
    import gzip

    out = {}
    for path in sorted(SCHEMAS.glob("*.yaml.gz")):
        # libyaml's loader: the RayJob CRD is 1.3 MB of YAML (6 s with the pure-Python one).
        crd = yaml.load(gzip.decompress(path.read_bytes()),
                        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        for v in crd["spec"]["versions"]:
            if v["served"]:
                key = (f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])
                out[key] = strict(v["schema"]["openAPIV3Schema"])
    return out


def kuberay_objects() -> list[dict]:
    return [d for name in ("rayjob.yaml", "kueue.yaml", "monitoring.yaml")
            for d in yaml.safe_load_all((ROOT / "cluster/kuberay" / name).read_text())]


def test_kuberay_manifests_validate_against_the_crds_of_the_releases_they_name():
    schemas = crd_schemas()
    kinds = []
    for doc in kuberay_objects():
        key = (doc["apiVersion"], doc["kind"])
        assert key in schemas, f"{key}: no vendored schema"
        body = {k: v for k, v in doc.items() if k != "metadata"}
        jsonschema.validate(body, schemas[key])
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ClusterQueue", "LocalQueue", "PodMonitor", "PodMonitor",
                             "RayJob", "ResourceFlavor"]
    # The RayCluster's spec is the RayJob's rayClusterSpec schema.
    cluster_schema = schemas[("ray.io/v1", "RayJob")]["properties"]["spec"]["properties"][
        "rayClusterSpec"]
    jsonschema.validate(ray_cluster()["spec"], cluster_schema)
    # Strict: a misspelled field is refused.
    job = yaml.safe_load((ROOT / "cluster/kuberay/rayjob.yaml").read_text())
    job["spec"]["shutdownAfterJobFinished"] = True
    with pytest.raises(jsonschema.ValidationError, match="shutdownAfterJobFinished"):
        jsonschema.validate({k: v for k, v in job.items() if k != "metadata"},
                            schemas[("ray.io/v1", "RayJob")])


def quantity(value: str | int) -> float:
    """A Kubernetes quantity ("500m", "32Gi", "8") as a number."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    text = str(value)
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


# What KubeRay gives the autoscaler's sidecar when autoscalerOptions names no resources, which
# Kueue adds to the head's pod (kueue pkg/controller/jobs/raycluster: defaultAutoscalerResources).
AUTOSCALER = {"cpu": 0.5, "memory": 512 * 2**20}


def test_the_rayjob_is_one_kueue_admits_and_its_queue_fits_it():
    """Kueue's own admission rules for a RayJob (v0.19's rayjob webhook, transcribed), and a
    ClusterQueue quota that admits the job's minimum at once and holds it at its largest."""
    from raylm.config import load_config

    job = yaml.safe_load((ROOT / "cluster/kuberay/rayjob.yaml").read_text())
    docs = {(d["kind"], d["metadata"]["name"]): d for d in kuberay_objects()}
    spec, cluster = job["spec"], job["spec"]["rayClusterSpec"]
    local = docs[("LocalQueue", job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"])]
    assert local["metadata"]["namespace"] == job["metadata"]["namespace"]
    queue = docs[("ClusterQueue", local["spec"]["clusterQueue"])]
    assert spec["suspend"] is True and spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec and spec["activeDeadlineSeconds"] > 0
    if cluster["enableInTreeAutoscaling"]:
        assert job["metadata"]["annotations"]["kueue.x-k8s.io/elastic-job"] == "true"
    groups = cluster["workerGroupSpecs"]
    assert 1 + len(groups) <= 18 and all(g["groupName"] != "head" for g in groups)

    def requests(template: dict) -> dict[str, float]:
        total = {"cpu": 0.0, "memory": 0.0, "nvidia.com/gpu": 0.0}
        for c in template["spec"]["containers"]:
            assert c["resources"]["requests"] == c["resources"]["limits"], c["name"]
            for k, v in c["resources"]["requests"].items():
                total[k] += quantity(v)
        return total

    head = requests(cluster["headGroupSpec"]["template"])
    for k, v in AUTOSCALER.items():
        head[k] += v

    def demand(count: str) -> dict[str, float]:
        out = dict(head)
        for g in groups:
            for k, v in requests(g["template"]).items():
                out[k] += g[count] * v
        return out

    (flavor,) = queue["spec"]["resourceGroups"][0]["flavors"]
    assert ("ResourceFlavor", flavor["name"]) in docs
    quota = {r["name"]: quantity(r["nominalQuota"]) for r in flavor["resources"]}
    assert set(quota) == set(queue["spec"]["resourceGroups"][0]["coveredResources"])
    for k in quota:
        assert demand("replicas")[k] <= demand("maxReplicas")[k] <= quota[k], k
    # The training group's admitted size is the run's minimum: its workers over the pod's GPUs.
    train = next(g for g in groups if g["groupName"] == "gpu-train")
    config = spec["entrypoint"].split("--config ")[1].split()[0]
    lo, _ = load_config(str(ROOT / config), []).scaling.worker_range
    per_pod = quantity(train["template"]["spec"]["containers"][0]["resources"]["requests"][
        "nvidia.com/gpu"])
    assert train["replicas"] == train["minReplicas"] == -(-lo // int(per_pod))


def test_prometheus_scrapes_every_ray_pod_and_gpu_and_grafana_gets_the_dashboard():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    # KubeRay: the PodMonitor selects the Ray pods by a label they carry, on a port each
    # container names.
    monitors = {d["metadata"]["name"]: d for d in kuberay_objects() if d["kind"] == "PodMonitor"}
    ray_monitor = monitors["raylm-ray"]
    cluster = ray_cluster()
    for pod in [cluster["spec"]["headGroupSpec"]["template"],
                *(g["template"] for g in cluster["spec"]["workerGroupSpecs"])]:
        assert ray_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"][
            "labels"].items()
        for c in containers(pod["spec"]):
            assert {"containerPort": 8080, "name": "metrics"} in c["ports"]
    assert ray_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitors["raylm-dcgm"]["spec"]["selector"]["matchLabels"] == {
        "app": "nvidia-dcgm-exporter"}

    # The launcher: Prometheus reads Ray's service discovery file, and the DCGM job maps each
    # listed host to port 9400 (Prometheus anchors the regex at both ends: fullmatch).
    prom = yaml.safe_load((ROOT / "cluster/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    sd = f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"
    for job in jobs.values():
        assert job["file_sd_configs"] == [{"files": [sd]}]
    (relabel,) = jobs["dcgm"]["relabel_configs"]
    assert relabel["source_labels"] == ["__address__"]
    assert relabel["target_label"] == "__address__"
    found = re.fullmatch(relabel["regex"], "10.0.0.5:44217")
    assert re.sub(r"\$\{(\d)\}", lambda m: found[int(m[1])],
                  relabel["replacement"]) == "10.0.0.5:9400"
    for name in LAUNCHER:
        cfg = launcher(name)
        (dcgm,) = [c for c in cfg["initialization_commands"] if "dcgm-exporter" in c]
        assert dcgm.startswith("if nvidia-smi -L") and "-p 9400:9400" in dcgm
        assert "dcp-metrics-included.csv" in dcgm
        assert any("cluster/grafana/raylm.json /tmp/ray/session_latest/metrics/grafana/"
                   "dashboards/" in c for c in cfg["head_start_ray_commands"])


def test_the_dashboard_shows_every_live_series_and_names_only_series_that_exist():
    import json

    from raylm.live import RUN_FIGURES, WORKER_FIGURES

    dashboard = json.loads((ROOT / "cluster/grafana/raylm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row"
             for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    raylm = {f"ray_{name}" for name, *_ in (*WORKER_FIGURES, *RUN_FIGURES)}
    # The collectors the GPU operator's exporter and the launcher's container run.
    dcgm = {line.split(",")[0].strip()
            for line in (SCHEMAS / "dcp-metrics-included.csv").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    named = set()
    for expr in exprs:
        series = set(re.findall(r"\b(ray_raylm_\w+|DCGM_\w+)\b", expr))
        assert series, expr
        named |= series
    assert named - raylm - dcgm == set()
    assert raylm <= named  # every live series has a panel
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
