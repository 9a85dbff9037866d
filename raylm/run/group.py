"""The workers' process group, formed by Ray Train's controller without importing torch.

Ray Train's ``TorchConfig`` is defined in a module that imports torch, and the controller
unpickles the trainer's backend configuration, so every run's controller imported torch (1.2
to 1.5 CPU-s of its start on the 2-core machine) only to have the workers form their process
group.
:class:`ProcessGroup` does what ``TorchConfig`` does, with Ray's own setup functions imported in
the workers, which have torch loaded anyway.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.train import constants
from ray.train.backend import Backend, BackendConfig

from raylm import compat


@dataclass
class ProcessGroup(BackendConfig):
    backend: str = "gloo"  # nccl on GPUs
    timeout_s: int = 1800  # train.collective_timeout_s

    @property
    def backend_cls(self):
        return GroupSetup

    @property
    def train_func_context(self):
        return compat.TorchConfigContextManager

    @property
    def framework(self):
        return compat.TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "timeout_s": self.timeout_s}


def join(address: str, port: int, rank: int, size: int, backend: str, timeout_s: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    compat._set_torch_distributed_env_vars()
    compat._setup_torch_process_group(backend=backend, world_rank=rank, world_size=size,
                                      init_method="env://", timeout_s=timeout_s)


def leave(destroy: bool) -> None:
    compat._shutdown_torch(destroy_process_group=destroy)


class GroupSetup(Backend):
    # A worker sees its node's GPUs and takes its own by local rank, as under TorchConfig.
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: ProcessGroup) -> None:
        address, port = worker_group.execute_single(0, compat.get_address_and_port)
        n, c = len(worker_group), backend_config
        ray.get([worker_group.execute_single_async(r, join, address, port, r, n, c.backend,
                                                   c.timeout_s) for r in range(n)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroup) -> None:
        timeout_s = float(os.environ.get(constants.TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                         constants.DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(worker_group.execute_async(leave, len(worker_group) > 1), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logging.getLogger(__name__).warning(
                "the workers' process group did not shut down within %s s", timeout_s)
