"""Fixtures of the data tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    """The test tokenizer (tests/conftest.py trains it) as the tokenizers library loads it."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
