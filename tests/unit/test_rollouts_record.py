"""What a checkpoint keeps of an off-policy run's rollouts (raylm.contracts.rollouts'
SavedRollouts), read back field by field, with the sampling that made them; a file of version 1
(cb5e3f1 and before: no version, no sampling) reads as before. The generator actors' side is
tests/integration/test_rl.py's."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from raylm.contracts import Malformed
from raylm.contracts.rollouts import Group, Sampling, SavedRollouts, group_from_dict

SAMPLING = Sampling(group_size=2, temperature=0.9, top_p=1.0, max_tokens=4)


def group(position: int = 4) -> Group:
    return Group(position, 3, [1, 2], [[7, 0], [8]], [[-0.5, -1.25], [-2.0]], [1.0, 0.0],
                 {"reward": [1.0, 0.0]}, [False, True], 0, None, {"generate_s": 0.01})


def test_kept_groups_read_back_as_they_were_saved_with_their_sampling():
    saved = SavedRollouts(9, [group(4), group(5)], SAMPLING)
    again = SavedRollouts.from_json(saved.to_json())
    assert again == saved and json.loads(saved.to_json())["version"] == 2
    assert SAMPLING.differences(Sampling(4, 0.9, 1.0, 4)) == ["group_size 2 -> 4"]
    # Version 1, as cb5e3f1 wrote it: no version, no sampling; with a KL penalty's reference
    # log-probabilities, and without them (before the KL penalty reached full fine-tuning, a
    # group had no such field): None.
    kl = Group(**{**asdict(group(6)), "ref_logps": [[-0.4, -1.0], [-2.5]]})
    old = {k: v for k, v in asdict(group(7)).items() if k != "ref_logps"}
    first = SavedRollouts.from_json(json.dumps({"through_step": 9, "groups": [asdict(kl), old]}))
    assert first == SavedRollouts(9, [kl, group(7)], None)


@pytest.mark.parametrize("change", [
    {"logps": [[-0.5], [-2.0]]},             # a completion's tokens without their logps
    {"ref_logps": [[-0.5, -1.0], [-2.0, 0.0]]},
    {"ref_logps": [[-0.5, -1.0]]},
    {"rewards": [1.0, float("nan")]},
    {"completions": [[7, "0"], [8]]},
    {"completions": [], "logps": [], "rewards": [], "truncated": [], "parts": {}},
    {"truncated": [0, 1]},
    {"version": 3.5},
    {"extra": 1},
])
def test_a_malformed_group_is_refused_by_its_file(change):
    with pytest.raises(Malformed, match="rollouts.json is malformed"):
        group_from_dict({**asdict(group()), **change})
    bad = json.dumps({"through_step": 1, "groups": [{**asdict(group()), **change}]})
    with pytest.raises(Malformed, match="rollouts.json is malformed"):
        SavedRollouts.from_json(bad)


@pytest.mark.parametrize("data", [
    b"\x80pickle", b'{"groups": []}', b'{"through_step": "1", "groups": []}',
    b'{"version": 3, "through_step": 1, "groups": []}',
    b'{"version": 2, "through_step": 1, "groups": [], "sampling": {"group_size": 1e400}}'])
def test_what_is_not_json_lacks_its_step_or_is_newer_is_refused(data):
    with pytest.raises(Malformed, match="rollouts.json is"):
        SavedRollouts.from_json(data)
