import subprocess
import sys

import cloudpickle

from raylm.run.group import GroupSetup, ProcessGroup


def test_the_controller_reads_the_process_group_setup_without_torch():
    """What Ray Train's controller unpickles and calls to form the workers' process group (the
    backend configuration, its backend class, the run state's framework) loads no torch; the
    workers' side of it does."""
    pickled = cloudpickle.dumps(ProcessGroup(backend="gloo", timeout_s=30))
    code = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
            "assert c.backend_cls.__name__ == 'GroupSetup' and c.framework.value == 'torch'; "
            "assert c.to_dict() == {'backend': 'gloo', 'timeout_s': 30}; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], input=pickled, check=True, timeout=120)
    assert ProcessGroup().backend_cls is GroupSetup and GroupSetup.share_cuda_visible_devices
    assert ProcessGroup().train_func_context.__module__ == "ray.train.torch.config"
