"""Models and tokenizers named as a model card names them: a Hugging Face hub id.

``model.path`` and ``tokenizer.path`` take a local directory or a hub id (``org/name``,
optionally ``@revision``). An id is resolved on the driver, before Ray starts, by
``huggingface_hub.snapshot_download``: the files a causal LM needs (config, weights, tokenizer,
chat template) go into the hub cache, and the run continues with that snapshot's directory, so
every worker loads the same revision and a typo, a gated model or a missing revision is refused
in one line. ``HF_HUB_OFFLINE=1`` resolves from the cache alone; ``HF_HUB_CACHE`` (or
``HF_HOME``) says where the cache is. Workers read the snapshot directory as the driver names
it: on several nodes, put the cache on storage every node mounts (the cluster files mount one
under /mnt/raylm), as for any ``model.path``.

A value that exists as a local path is always that path: ``runs/base`` is a directory if there
is one, and is looked up on the hub only if there is none and ``runs`` is not a local
directory either (then it is a path with a typo, refused). An id without ``@revision`` follows
the hub's ``main``: the commit it resolved to is printed, and is part of the run's identity
(a resume onto a new commit is refused as a changed base).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from raylm import storage

# org/name as the hub spells them (letters, digits, '-', '_', '.'), optional @revision: a
# branch, tag or commit of the same characters, never '.' or '..' (the revision names a file
# under the cache's refs/).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@(?!\.\.?$)[\w.-]+)?$")
# What a causal LM directory needs, by extension; the rest of a repository (other formats'
# weights, images, training logs) is not fetched, nor is code (a model's or a tokenizer's
# `.py` files, which raylm never runs: every load passes trust_remote_code=False).
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(value: str) -> bool:
    """Whether ``value`` names a hub repository rather than an existing local path."""
    return (not storage.is_uri(value) and not Path(value).expanduser().exists()
            and bool(HUB_ID.match(value)))


def resolve(value: str, *, key: str, log=print) -> str:
    """The local directory of hub id ``value`` (``key`` names the setting in errors)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = value.partition("@")
    org = Path(repo_id.split("/")[0]).expanduser()
    if org.is_dir():
        raise ValueError(f"{key}={value!r}: no directory of that name here, though {org}/ is "
                         f"one (a typo in the path?). A value whose first part is a local "
                         f"directory is not looked up on the hub.")
    # Read here, not at import: huggingface_hub fixes its constants when first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        snapshot = snapshot_download(repo_id, revision=revision or None, allow_patterns=FILES,
                                     cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                     local_files_only=offline)
    except GatedRepoError:
        raise ValueError(f"{key}={value!r}: the model is gated on the hub; accept its licence "
                         f"there and log in (huggingface-cli login or HF_TOKEN).") from None
    except RevisionNotFoundError:
        raise ValueError(f"{key}={value!r}: the hub has no revision {revision!r} of "
                         f"{repo_id}.") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{key}={value!r}: no directory of that name here, and no model "
                         f"{repo_id!r} on the hub (or it is private: log in).") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE=1 and the hub cache" if offline else "the hub (unreachable?)"
        raise ValueError(f"{key}={value!r}: no directory of that name here, and {where} does "
                         f"not have it; download it where there is network (huggingface-cli "
                         f"download {repo_id}) into the cache this machine reads.") from None
    commit = Path(snapshot).name  # the cache names a snapshot by its commit
    if revision != commit:
        log(f"raylm: {key}={value} is the hub's commit {commit} (the run's identity records "
            f"it; {repo_id}@{commit} pins it)")
    return snapshot


def with_hub_snapshots(cfg):
    """``cfg`` with a hub id in ``model.path`` or ``tokenizer.path`` replaced by its snapshot
    directory (``cfg`` itself when neither is one)."""
    model, tokenizer = cfg.model, cfg.tokenizer
    if model.path and is_hub_id(model.path):
        model = dataclasses.replace(model, path=resolve(model.path, key="model.path"))
    if tokenizer.path and is_hub_id(tokenizer.path):
        tokenizer = dataclasses.replace(tokenizer,
                                        path=resolve(tokenizer.path, key="tokenizer.path"))
    if model is cfg.model and tokenizer is cfg.tokenizer:
        return cfg
    return dataclasses.replace(cfg, model=model, tokenizer=tokenizer)
