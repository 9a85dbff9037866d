"""GRPO's advantages and policy loss (raylm.workers.grpo) against a dense, per-completion
formulation written out here."""

from __future__ import annotations

import pytest
import torch

from raylm.workers.grpo import Clip, group_advantages, token_losses, token_weights


def test_advantages_are_centered_and_scaled_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, alike = group_advantages(rewards, group_size=4)
    first = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (torch.tensor([1.0, 0, 0, 1]).std() + 1e-4)
    assert torch.allclose(adv[:4], first)
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal: all alike
    assert alike.tolist() == [False, True]
    centered, _ = group_advantages(rewards, group_size=4, normalize=False)
    assert centered[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="do not make groups of 3"):
        group_advantages(rewards, group_size=3)


def dense_loss(logp, old, adv, mask, *, low, high, ref=None, beta=0.0, aggregation, max_len):
    """The same loss on (completions, tokens) tensors with a mask, aggregated per variant."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per = -torch.min(ratio * a, ratio.clamp(1 - low, 1 + high) * a)
    if ref is not None:
        per = per + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    per = per * mask
    if aggregation == "sequence":
        return (per.sum(1) / mask.sum(1)).mean()
    if aggregation == "token":
        return per.sum() / mask.sum()
    return per.sum() / (mask.size(0) * max_len)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_flat_loss_and_its_gradient_equal_the_dense_ones(aggregation, beta):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 1, 5, 2])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    logp = torch.randn(4, 5).mul(0.5).sub(2).requires_grad_()
    old = (logp.detach() + torch.randn(4, 5) * 0.3)
    ref = logp.detach() + torch.randn(4, 5) * 0.2
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])

    dense = dense_loss(logp, old, adv, mask, low=0.2, high=0.28, ref=ref, beta=beta,
                       aggregation=aggregation, max_len=8)
    (g_dense,) = torch.autograd.grad(dense, logp)

    at = torch.nonzero(mask.reshape(-1)).squeeze(1)
    index = at // 5
    flat = lambda t: t.reshape(-1).index_select(0, at)  # noqa: E731
    per, figures = token_losses(flat(logp), flat(old), adv.index_select(0, index),
                                clip=Clip(0.2, 0.28), ref_logp=flat(ref), kl_coef=beta)
    weights, denominator = token_weights(index, lengths, aggregation=aggregation, max_tokens=8)
    loss = (per * weights).sum() / denominator
    (g_flat,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(loss, dense, atol=1e-6)
    assert torch.allclose(g_flat, g_dense, atol=1e-6)
    assert figures["kl"].sum().item() == 0.0 if beta == 0 else figures["kl"].min() >= 0


def test_the_clip_holds_only_where_it_binds():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.5, 0.5, 1.5])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    per, figures = token_losses(logp, old, adv, clip=Clip(0.2, 0.28))
    # Ratio 0.5 with A < 0: clipped to 0.8 (no gradient); 1.5 with A > 0: held at 1.28;
    # the other two are where the objective is pessimistic: the unclipped term counts.
    assert per.detach().tolist() == pytest.approx([0.8, -1.28, -0.5, 1.5])
    assert figures["clipped_low"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert figures["clipped_high"].tolist() == [0.0, 1.0, 0.0, 0.0]
    (grad,) = torch.autograd.grad(per.sum(), logp)
    assert grad.tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5])


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="token, sequence or constant"):
        token_weights(torch.zeros(1, dtype=torch.long), torch.ones(1), aggregation="mean",
                      max_tokens=4)


def test_a_prompt_block_gives_its_prompt_and_rollouts_target_their_completions():
    from raylm.rollout.generator import Group
    from raylm.workers.grpo import prompt_tokens, rollout_batch

    block = {"input_ids": torch.tensor([[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])}
    assert prompt_tokens(block) == [[5, 6, 7], [8, 9]]
    groups = [Group(3, 0, [5, 6, 7], [[11, 0], [12]], [[-0.1, -0.2], [-0.3]], [1.0, 0.0],
                    {}, [False, True])]
    r = rollout_batch(groups, torch.tensor([0.7, -0.7]), pad_id=0)
    assert r.batch["input_ids"].tolist() == [[5, 6, 7, 11, 0, 0], [5, 6, 7, 12, 0, 0]]
    assert r.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1]]
    targets = r.batch["input_ids"][:, 1:].reshape(-1)
    # The completions' tokens, each predicted from the position before it.
    assert targets[r.at].tolist() == [11, 0, 12]
    assert r.index.tolist() == [0, 0, 1] and r.lengths.tolist() == [2, 1]
    assert r.old_logp.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert r.ref_logp is None
    # A KL penalty's reference log-probabilities line up with the sampling ones.
    groups[0].ref_logps = [[-0.4, -0.5], [-0.6]]
    r = rollout_batch(groups, torch.tensor([0.7, -0.7]), pad_id=0)
    assert r.ref_logp.tolist() == pytest.approx([-0.4, -0.5, -0.6])


def test_an_off_policy_step_asks_for_the_steps_up_to_its_staleness_once():
    """K steps ahead of the one trained, each asked for once; none past the run's end; the
    stream gives every micro-batch in order, the ones looked at included."""
    from raylm.config import load_config
    from raylm.workers.grpo import Reinforce, Upcoming

    cfg = load_config(None, ["--train.objective=grpo", "--data.format=prompt",
                             "--rl.reward=exact_match", "--rl.max_staleness=2",
                             "--train.steps=5"])
    objective = Reinforce(cfg, prepared="unused", eos_id=0, vocab_size=8, rank=1)
    stream = Upcoming(iter([{"step": s, "part": k} for s in range(5) for k in range(2)]),
                      per_step=2)
    objective.upcoming = stream
    asked, trained = [], []
    for step in range(5):
        trained.append([next(stream)["step"] for _ in range(2)])
        objective.at = step
        asked.append([m[0]["step"] for m in objective.steps_ahead()])
    assert trained == [[s, s] for s in range(5)]
    assert asked == [[1, 2], [3], [4], [], []]


def test_a_reward_error_is_said_once_and_only_the_first_few_distinct_ones():
    from raylm.rollout.generator import Group
    from raylm.workers.grpo import ERRORS_SAID, reward_warning

    def group(failed: int, error: str | None) -> Group:
        return Group(0, 1, [1], [[2], [3]], [[-1.0], [-1.0]], [0.0, 1.0], {}, [False, False],
                     failed, error, {})

    said: set[str] = set()
    assert reward_warning([group(0, None)], step=3, said=said) is None
    line = reward_warning([group(0, None), group(1, "KeyError: 'answer'"),
                           group(2, "ValueError: x")], step=3, said=said)
    assert line == ("raylm: warning: rl.reward failed on 3 completion(s) of step 3, each "
                    "scored 0 (rl_reward_failures counts them): KeyError: 'answer'")
    assert reward_warning([group(1, "KeyError: 'answer'")], step=4, said=said) is None
    for k in range(ERRORS_SAID - 2):
        assert reward_warning([group(1, f"E{k}")], step=5, said=said)
    assert reward_warning([group(1, "last")], step=6, said=said).endswith(
        "last; later errors are counted, not said")
    assert reward_warning([group(1, "one more")], step=7, said=said) is None
