"""Which failures end a run at once (mistakes) and which are retried (faults)."""

from __future__ import annotations

import math

import pytest
import torch

from raylm.faults import Mistake, cause
from raylm.model.assemble import batch_loss, build_training_model, logit_spread
from raylm.workers.health import first_prediction_check
from tests.conftest import save_tiny_qwen3


def test_a_model_predicting_every_token_alike_is_a_mistake_not_a_loss_of_ln_vocab(tmp_path):
    """The check tests the cause it names, from the logits: a random-weight Qwen3 whose first
    loss lands on ln(vocab) (one trained target, chosen so) trains; the same model with every
    weight zero does not."""
    vocab = 1500
    batch = {"input_ids": torch.randint(1, vocab, (2, 17),
                                        generator=torch.Generator().manual_seed(0)),
             "loss_mask": torch.zeros(2, 17, dtype=torch.long)}

    def build(path):
        return build_training_model(preset=None, path=str(path), vocab_size=vocab, eos_id=0,
                                    device=torch.device("cpu"), precision="fp32")

    random = build(save_tiny_qwen3(tmp_path / "random", vocab_size=vocab))
    with torch.no_grad():
        logits = random.model(input_ids=batch["input_ids"][:1, :-1]).logits[0, -1]
    # The one trained target: the token whose log-probability is nearest -ln(vocab).
    logp = torch.log_softmax(logits.float(), dim=-1)
    batch["input_ids"][0, -1] = int((logp + math.log(vocab)).abs().argmin())
    batch["loss_mask"][0, -1] = 1
    with torch.no_grad():  # the sum over one target
        loss = float(batch_loss(random, batch, cross_document=True))
    assert abs(loss - math.log(vocab)) <= 1e-5 * math.log(vocab)  # what fooled a loss check
    spread = logit_spread(random, batch, cross_document=True)
    assert 0.05 < spread < 1.0
    first_prediction_check(spread, model_path="/models/random")

    zero = build(save_tiny_qwen3(tmp_path / "zero", vocab_size=vocab, zero=True))
    assert logit_spread(zero, batch, cross_document=True) == 0.0
    with pytest.raises(Mistake, match=r"/models/zero: the model predicts every token alike "
                                      r"\(its logits vary by 0 .*did not load"):
        first_prediction_check(0.0, model_path="/models/zero")


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
