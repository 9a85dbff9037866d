"""The numerics gate: the fixed tiny runs of tests/numerics.py reproduce tests/losses.json.

A change that moves any recorded loss, gradient norm or validation loss fails here, even if
resumed and uninterrupted runs still agree with each other. Regenerate the file only for a
deliberate numerics change (``python -m tests.numerics --write``), and say why in the commit.
"""

from __future__ import annotations

import json

import pytest

from tests import numerics

RECORDED = json.loads(numerics.LOSSES.read_text())


def check(run_name: str, got: dict[str, list[float]]) -> None:
    want = RECORDED[run_name]
    assert got.keys() == want.keys()
    for key, values in want.items():
        assert len(got[key]) == len(values), key
        assert got[key] == pytest.approx(values, abs=numerics.TOLERANCE, rel=0), key


def test_single_process_run_reproduces_the_recorded_losses():
    check("single_process", numerics.run())


def test_fsdp2_two_rank_run_reproduces_the_recorded_losses():
    check("fsdp2_2_ranks", numerics.run_fsdp(2))
