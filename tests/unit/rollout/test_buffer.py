"""What a checkpoint keeps of an off-policy run's rollouts (raylm.rollout.buffer), read back
field by field; the generator actors' side is tests/integration/test_rl.py's."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from raylm.rollout.buffer import group_from_dict, load_saved
from raylm.rollout.generator import Group


def group(position: int = 4) -> Group:
    return Group(position, 3, [1, 2], [[7, 0], [8]], [[-0.5, -1.25], [-2.0]], [1.0, 0.0],
                 {"reward": [1.0, 0.0]}, [False, True], 0, None, {"generate_s": 0.01})


def test_kept_groups_read_back_as_they_were_saved():
    data = json.dumps({"through_step": 9, "groups": [asdict(group(4)), asdict(group(5))]})
    through, groups = load_saved(data.encode(), where="ckpt/rollouts.json")
    assert through == 9 and groups == {4: group(4), 5: group(5)}
    # With a KL penalty's reference log-probabilities; without them (before the KL penalty
    # reached full fine-tuning, a group had no such field): None.
    kl = Group(**{**asdict(group(6)), "ref_logps": [[-0.4, -1.0], [-2.5]]})
    old = {k: v for k, v in asdict(group(7)).items() if k != "ref_logps"}
    data = json.dumps({"through_step": 9, "groups": [asdict(kl), old]})
    assert load_saved(data.encode(), where="rollouts.json")[1] == {6: kl, 7: group(7)}


@pytest.mark.parametrize("change", [
    {"logps": [[-0.5], [-2.0]]},             # a completion's tokens without their logps
    {"ref_logps": [[-0.5, -1.0], [-2.0, 0.0]]},
    {"ref_logps": [[-0.5, -1.0]]},
    {"rewards": [1.0, float("nan")]},
    {"completions": [[7, "0"], [8]]},
    {"truncated": [0, 1]},
    {"version": 3.5},
    {"extra": 1},
])
def test_a_malformed_group_is_refused_by_its_file(change):
    with pytest.raises(TypeError):
        group_from_dict({**asdict(group()), **change})
    bad = json.dumps({"through_step": 1, "groups": [{**asdict(group()), **change}]})
    with pytest.raises(ValueError, match="ckpt/rollouts.json: not the rollouts raylm keeps"):
        load_saved(bad.encode(), where="ckpt/rollouts.json")


def test_what_is_not_json_or_lacks_its_step_is_refused():
    for data in (b"\x80pickle", b'{"groups": []}', b'{"through_step": "1", "groups": []}'):
        with pytest.raises(ValueError, match="not the rollouts raylm keeps"):
            load_saved(data, where="rollouts.json")
