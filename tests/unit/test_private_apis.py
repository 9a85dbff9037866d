"""Every private API raylm reaches into, in one list: an upgrade of Python, Ray, torch or
MLflow that moves or removes one fails here, by name, rather than as a quiet loss of a feature
(a mistake retried as a fault, a drain notice never read, a planted pickle read without
checks).

The floors in pyproject.toml are the versions these were read from; where one falls, this file
says what to look at."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

# (module, attribute or None, what raylm uses it for, where)
PRIVATE = [
    ("ray.train.v2._internal.execution.callback", "ControllerCallback",
     "the run's end and restart decisions reach the record", "raylm/run/record.py"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback",
     "a worker's mistake is seen in the poll status; each group's placement is timed for the "
     "goodput ledger", "raylm/run/record.py"),
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision",
     "a retry is told from the end of a run", "raylm/run/record.py"),
    ("ray.train.v2._internal.execution.context", "get_train_context",
     "the node-drain notice with its deadline, and the queue of a worker's reports (a "
     "preempted group stops once its last report is taken); the module whose per-report log "
     "lines are quieted", "raylm/workers/preemption.py, raylm/console.py"),
    ("ray._private.services", "find_bootstrap_address",
     "the head `ray start` recorded on this machine", "raylm/run/cluster.py"),
    ("ray._common.utils", "reset_ray_address",
     "a benchmark's own head forgotten once it stops", "raylm/bench/scale.py"),
    ("torch.distributed.checkpoint._traverse", "set_element",
     "a checkpoint's non-tensor items, read as data only, go where DCP's own planner puts "
     "them", "raylm/workers/checkpoint.py"),
    ("mlflow.server.auth.sqlalchemy_store", "SqlAlchemyStore",
     "the cluster's MLflow server makes the runs' user an ordinary one, apart from the admin",
     "cluster/mlflow.sh"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
     "activation checkpointing of decoder blocks", "raylm/model/parallelize.py"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
     "_AutoscalingCoordinatorActor", "an elastic run's coordinator reads the cluster's nodes again "
     "at each restart, not 20 s later", "raylm/run/record.py"),
    ("atexit", "_run_exitfuncs",
     "the command's exit handlers, run before it ends without the interpreter's teardown",
     "raylm/cli.py"),
    ("ray.train.v2._internal.util", "TrainingFramework",
     "the workers' process group is a torch one to Ray's run state", "raylm/run/group.py"),
    ("ray.train._internal.utils", "get_address_and_port",
     "the process group's rendezvous on rank 0's node", "raylm/run/group.py"),
    ("ray.train.torch.config", "TorchConfigContextManager",
     "each worker's CUDA device made current, as under TorchConfig", "raylm/run/group.py"),
    ("ray.train.torch.config", "_set_torch_distributed_env_vars",
     "RANK, LOCAL_RANK, WORLD_SIZE and the rest set before the group forms",
     "raylm/run/group.py"),
    ("ray.train.torch.config", "_setup_torch_process_group",
     "the process group formed (gloo or NCCL) with the run's collective timeout",
     "raylm/run/group.py"),
    ("ray.train.torch.config", "_shutdown_torch",
     "the process group left when a worker group ends", "raylm/run/group.py"),
    ("ray._raylet", "GcsClient",
     "a head that refuses the token is said at once, not after ray.init's 20 s of retries",
     "raylm/run/cluster.py"),
]


def test_raylm_imports_private_names_only_through_raylm_compat():
    """raylm.compat is their one home: every name it gives is one of the list above, where the
    list says, and no other module of raylm imports a private module (one with a part that
    starts with ``_``) itself."""
    import ast
    from pathlib import Path

    from raylm import compat

    listed = {(m, n) for m, n, _, _ in PRIVATE}
    assert {(m, n) for n, m in compat._HOME.items()} <= listed
    for name in compat._HOME:
        assert getattr(compat, name) is not None
    with pytest.raises(AttributeError):
        compat.not_a_private_name  # noqa: B018
    root = Path(compat.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names
                      if any(part.startswith("_") and part != "__future__"
                             for part in n.split("."))]
    assert found == [], "import them through raylm.compat"


@pytest.mark.parametrize(("module", "name", "use", "where"), PRIVATE,
                         ids=[f"{m}.{n}" for m, n, _, _ in PRIVATE])
def test_each_private_api_raylm_uses_is_there(module, name, use, where):
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{name} is gone ({e}): {where} uses it for {use}")
    assert found is not None


def test_the_methods_raylm_overrides_or_calls_keep_their_shape(tmp_path, monkeypatch):
    # The monitor opens MLflow's default store, a database in the working directory, unless
    # told of another.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    # raylm.workers.checkpoint: SafeReader reads the metadata path DCP would, and RangeReader
    # replaces how DCP slices a shard's bytes out of a file.
    assert "rank" in inspect.signature(FileSystemReader._get_metadata_path).parameters
    assert list(inspect.signature(FileSystemReader._slice_file).parameters) == [
        "self", "file", "sinfo"]
    # raylm.workers.checkpoint.DataOnlyPlanner: replaces how DCP's planner reads a pickled
    # item, on the attributes DCP's planner keeps.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    assert list(inspect.signature(DefaultLoadPlanner.load_bytes).parameters) == [
        "self", "read_item", "value"]
    assert {"flatten_state_dict", "original_state_dict", "mappings"} <= set(
        vars(DefaultLoadPlanner()))
    # cluster/mlflow.sh: the user store's calls that make the runs' user.
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    assert list(inspect.signature(SqlAlchemyStore.create_user).parameters)[:4] == [
        "self", "username", "password", "is_admin"]
    assert {"password", "is_admin"} <= set(
        inspect.signature(SqlAlchemyStore.update_user).parameters)
    assert callable(SqlAlchemyStore.has_user) and callable(SqlAlchemyStore.init_db)
    # raylm.model.lora.adapters_off: the flag a LoRA layer's forward reads to skip its
    # adapters.
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert BaseTunerLayer._disable_adapters is False
    assert isinstance(BaseTunerLayer.disable_adapters, property)
    # raylm.run.tracking: whether the monitor's sampling process is alive.
    assert "_process" in SystemMetricsMonitor(run_id="x").__dict__
    # raylm.workers.preemption: where Ray Train keeps the drain notice.
    from ray.train.v2._internal.execution.context import TrainContext

    fields = ({f.name for f in dataclasses.fields(TrainContext)}
              if dataclasses.is_dataclass(TrainContext) else set(vars(TrainContext)))
    assert "preemption_context" in fields
    # raylm.workers.preemption.hand_over: the queue of this worker's reports the controller
    # takes them from, one per poll.
    assert callable(TrainContext.get_result_queue)
    # raylm.run.record.resource_wait: the placement group of a started worker group, and
    # how long Ray says it waited for resources.
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert callable(WorkerGroup.get_worker_group_state)
    assert "placement_group_handle" in {f.name for f in dataclasses.fields(WorkerGroupState)}
    assert "end_to_end_creation_latency_ms" in inspect.getsource(
        importlib.import_module("ray._private.state").GlobalState._gen_placement_group_info)
    # raylm.run.group: the keywords Ray's process-group setup and shutdown take.
    from ray.train.torch import config

    assert list(inspect.signature(config._setup_torch_process_group).parameters) == [
        "backend", "world_rank", "world_size", "init_method", "timeout_s"]
    assert list(inspect.signature(config._shutdown_torch).parameters) == [
        "destroy_process_group"]
    # raylm.run.record.FreshClusterView: the elastic policy's source of cluster resources, by
    # the name and namespace Ray creates it under, and its call that reads the nodes again.
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac

    made = inspect.getsource(dac.get_or_create_autoscaling_coordinator)
    assert 'name="AutoscalingCoordinator"' in made
    assert 'namespace="AutoscalingCoordinator"' in made
    # (Ray adds its own tracing parameter once a process has wrapped the class in ray.remote.)
    assert [p for p in inspect.signature(
        dac._AutoscalingCoordinatorActor.get_reserved_resources).parameters
        if not p.startswith("_ray")] == ["self", "requester_id", "recompute"]
    assert "TICK_INTERVAL_S = 20" in inspect.getsource(dac._AutoscalingCoordinatorActor)
