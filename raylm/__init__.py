"""raylm: elastic distributed language-model training on Ray.

The Python API (:mod:`raylm.api`) is importable from here: ``raylm.train``, ``raylm.tune``,
``raylm.prepare``, ``raylm.export``, ``raylm.prune``, ``raylm.generate``, ``raylm.evaluate``,
``raylm.Run``, ``raylm.Sweep``, ``raylm.Config``, ``raylm.load_config``. They are loaded on
first use, so that ``import raylm`` (and the ``raylm`` command's light subcommands) do not
import torch and Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

__all__ = ["prepare", "train", "tune", "export", "prune", "generate", "evaluate", "shutdown",
           "Run", "Sweep", "Config", "load_config"]
_CONFIG = ("Config", "load_config")

if TYPE_CHECKING:
    from raylm.api import (
        Run,
        Sweep,
        evaluate,
        export,
        generate,
        prepare,
        prune,
        shutdown,
        train,
        tune,
    )
    from raylm.config import Config, load_config


def __getattr__(name: str) -> Any:
    if name in __all__ and name not in _CONFIG:
        from raylm import api

        return getattr(api, name)
    if name in _CONFIG:
        from raylm import config

        return getattr(config, name)
    raise AttributeError(f"module 'raylm' has no attribute {name!r}")
