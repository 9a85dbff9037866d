"""Which writer an asynchronous checkpoint gets, and what it stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raylm.workers.checkpoint import choose_writer, staged_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def model() -> nn.Module:
    m = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10, bias=False))
    m[0].requires_grad_(False)  # frozen, as a LoRA base: not checkpointed
    return m


def test_a_save_stages_the_trainable_weights_and_their_two_moments():
    assert staged_bytes(model()) == 3 * 100 * 10 * 4


def test_auto_writes_from_a_thread_on_a_cpu_and_from_a_process_on_a_gpu(tmp_path):
    assert choose_writer("auto", device=CPU, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "thread"
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=8,
                         shm=str(tmp_path)) == "process"
    assert choose_writer("process", device=CPU, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "process"
    assert choose_writer("thread", device=CUDA, model=model(), workers_on_node=1,
                         shm=str(tmp_path)) == "thread"


def test_too_little_shared_memory_for_the_process_writer_is_named(tmp_path, capsys):
    # As many workers as make the node's staged state larger than any disk.
    crowd = 10**12
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=crowd,
                         shm=str(tmp_path)) == "thread"
    said = capsys.readouterr().out
    assert f"but {tmp_path} has" in said and "--shm-size" in said and "from a thread" in said
    with pytest.raises(ValueError, match="or set checkpoint.writer=thread"):
        choose_writer("process", device=CUDA, model=model(), workers_on_node=crowd,
                      shm=str(tmp_path))
    assert choose_writer("auto", device=CUDA, model=model(), workers_on_node=1,
                         shm=str(tmp_path / "absent")) == "thread"
