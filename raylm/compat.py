"""The private names of Ray, torch and Python that raylm imports, from here and nowhere else,
lazily (importing this module imports none of them). tests/unit/test_private_apis.py says what
each is for and checks it, with the private attributes raylm relies on besides, against the
pinned versions: an upgrade that moves one fails there, by name, not as a lost feature.
"""

import importlib

_HOME = {
    "ControllerCallback": "ray.train.v2._internal.execution.callback",
    "WorkerGroupCallback": "ray.train.v2._internal.execution.callback",
    "FailureDecision": "ray.train.v2._internal.execution.failure_handling",
    "get_train_context": "ray.train.v2._internal.execution.context",
    "find_bootstrap_address": "ray._private.services",
    "reset_ray_address": "ray._common.utils",
    "set_element": "torch.distributed.checkpoint._traverse",
    "checkpoint_wrapper": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "_run_exitfuncs": "atexit",
    "TrainingFramework": "ray.train.v2._internal.util",
    "get_address_and_port": "ray.train._internal.utils",
    "TorchConfigContextManager": "ray.train.torch.config",
    "_set_torch_distributed_env_vars": "ray.train.torch.config",
    "_setup_torch_process_group": "ray.train.torch.config",
    "_shutdown_torch": "ray.train.torch.config",
    "GcsClient": "ray._raylet",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
