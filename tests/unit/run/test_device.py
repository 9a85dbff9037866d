"""scaling.use_gpu: auto takes the cluster's GPUs where it has them, and says which and why."""

from __future__ import annotations

import pytest

from raylm.config import ConfigError, load_config
from raylm.run.launch import choose_device, plan_resources


def test_auto_uses_the_gpus_a_cluster_has_and_cpus_otherwise():
    cfg = load_config(None, [])
    assert cfg.scaling.use_gpu == "auto"
    on_gpu, line = choose_device(cfg, {"CPU": 16.0, "GPU": 1.0})
    assert on_gpu.scaling.use_gpu is True
    assert line == "workers on GPUs: scaling.use_gpu=auto and the cluster has 1 GPU"
    assert plan_resources(on_gpu, {"CPU": 16.0, "GPU": 1.0}).worker == {"CPU": 1.0, "GPU": 1.0}
    on_cpu, line = choose_device(cfg, {"CPU": 2.0})
    assert on_cpu.scaling.use_gpu is False
    assert line == ("workers on CPUs: scaling.use_gpu=auto and the cluster has no GPU (a "
                    "cluster with GPUs gets GPU workers)")
    # What the user set is kept, and said.
    pinned = load_config(None, ["--scaling.use_gpu=false"])
    assert choose_device(pinned, {"CPU": 16.0, "GPU": 8.0}) == (
        pinned, "workers on CPUs: scaling.use_gpu=false; the cluster has 8 GPUs")


def test_auto_refuses_what_only_gpus_run_and_an_autoscaler_it_cannot_read():
    nf4 = load_config(None, ["--model.path=/models/base", "--lora.rank=8",
                             "--lora.base_quantization=nf4"])
    assert choose_device(nf4, {"CPU": 8.0, "GPU": 2.0})[0].scaling.use_gpu is True
    with pytest.raises(ConfigError, match=r"'lora.base_quantization': 'nf4'. Allowed: none on "
                                          r"CPU workers.* \(the workers would run on CPUs: "
                                          r"scaling.use_gpu=auto and the cluster has no GPU\)"):
        choose_device(nf4, {"CPU": 8.0})
    waits = load_config(None, ["--scaling.wait_for_nodes=true"])
    with pytest.raises(ConfigError, match="scaling.use_gpu=auto cannot choose: the cluster has "
                                          "no GPU now but autoscales"):
        choose_device(waits, {"CPU": 2.0})
    assert choose_device(waits, {"CPU": 2.0, "GPU": 4.0})[0].scaling.use_gpu is True


def test_the_controller_polls_often_for_small_groups_and_never_overrides_the_user(monkeypatch):
    from raylm.run import launch

    assert [launch.poll_interval(n) for n in (1, 2, 64, 128, 192, 256, 1024)] == [
        0.5, 0.5, 0.5, 1.0, 1.5, 2.0, 2.0]
    monkeypatch.delenv(launch.POLL_ENV, raising=False)
    monkeypatch.setattr(launch, "_poll_set", {})
    launch.set_poll_interval(2)
    assert launch.os.environ[launch.POLL_ENV] == "0.5"
    launch.set_poll_interval(200)  # a later run of the same process, larger: raylm's own value
    assert launch.os.environ[launch.POLL_ENV] == "1.5625"
    monkeypatch.setenv(launch.POLL_ENV, "3")  # the user's
    launch.set_poll_interval(2)
    assert launch.os.environ[launch.POLL_ENV] == "3"
