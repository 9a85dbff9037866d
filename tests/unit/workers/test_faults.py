"""Which failures end a run at once (mistakes) and which are retried (faults)."""

from __future__ import annotations

import math

import pytest

from raylm.workers.faults import Mistake, cause, first_loss_check


def test_a_uniform_first_loss_is_a_mistake_and_a_random_or_trained_one_is_not():
    with pytest.raises(Mistake, match=r"loss 5\.9506 is ln\(384\).*did not load"):
        first_loss_check(math.log(384), vocab_size=384, model_path="/models/m")
    # A randomly initialized 64-wide model sits about 1e-2 above; a trained one far below.
    first_loss_check(math.log(384) + 0.005, vocab_size=384, model_path="/models/m")
    first_loss_check(2.78, vocab_size=49152, model_path="/models/m")


def test_the_mistake_is_found_inside_the_wrappers_ray_train_puts_around_it():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import ControllerError

    mistake = Mistake("rank 0: model.path=/m: ...")
    # A worker's error as the controller polls it; a callback's error as fit() raises it.
    assert cause(UserExceptionWithTraceback(mistake, "Traceback ...")) is mistake
    assert cause(ControllerError(mistake)) is mistake
    try:
        raise RuntimeError("outer") from mistake
    except RuntimeError as e:
        assert cause(e) is mistake
    # A machine's fault is none.
    assert cause(UserExceptionWithTraceback(ConnectionResetError("peer"), "...")) is None
    assert cause(RuntimeError("NCCL timeout")) is None
