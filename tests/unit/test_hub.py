"""Models by hub id, offline: a hub cache filled here (the layout huggingface_hub writes:
models--ORG--NAME/snapshots/REV, refs/main) with a model built here, loaded by its id; a
wrong id or a bad LoRA target refused before Ray starts, naming it."""

from __future__ import annotations

import pytest
import torch

from raylm.cli import main
from raylm.config import load_config
from raylm.hub import is_hub_id, with_hub_snapshots
from tests.conftest import save_tiny_llama

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """``acme/tiny`` in an offline hub cache; returns its snapshot directory."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / REVISION
    save_tiny_llama(snapshot, vocab_size=512)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return snapshot



def test_a_hub_id_loads_the_cached_snapshot(hub_cache):
    from raylm.model.assemble import build_training_model

    cfg = load_config(None, ["--model.path=acme/tiny", "--lora.rank=4"])
    assert cfg.model.path == "acme/tiny"  # not made a path under the working directory
    resolved = with_hub_snapshots(cfg)
    assert resolved.model.path == str(hub_cache)
    assert with_hub_snapshots(load_config(None, [f"--model.path=acme/tiny@{REVISION}"])
                           ).model.path == str(hub_cache)
    built = build_training_model(preset=None, path=resolved.model.path, vocab_size=512,
                                 eos_id=0, device=torch.device("cpu"), precision="fp32")
    assert built.config.num_hidden_layers == 2


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(hub_cache):
    local = hub_cache.parents[3] / "acme" / "tiny"
    save_tiny_llama(local, vocab_size=512)
    assert not is_hub_id("acme/tiny")
    assert load_config(None, ["--model.path=acme/tiny"]).model.path == str(local)


@pytest.mark.parametrize("overrides, message", [
    (["--model.path=acme/tiyn"],
     "raylm: error: model.path='acme/tiyn': no directory of that name here, and "
     "HF_HUB_OFFLINE=1 and the hub cache does not have it"),
    (["--model.path=acme/tiny", "--lora.rank=4", "--lora.target_modules=[qkv_proj]"],
     "raylm: error: lora.target_modules: qkv_proj is not a linear layer of this model"),
])
def test_bad_model_inputs_are_refused_before_ray_starts(hub_cache, capsys, ray_never_starts,
                                                        overrides, message):
    assert main(["train", *overrides, "--tracking.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_missing_path_under_a_local_directory_is_not_looked_up_on_the_hub(hub_cache,
                                                                            capsys):
    """``runs/base`` with ``runs/`` here but no ``base`` in it is a typo, not a hub model of an
    organisation called runs; an id without a revision says the commit it follows."""
    (hub_cache.parents[3] / "acme").mkdir()
    with pytest.raises(ValueError, match=r"model.path='acme/tiny': no directory of that name "
                                         r"here, though acme/ is one \(a typo in the path\?\)"):
        with_hub_snapshots(load_config(None, ["--model.path=acme/tiny"]))
    (hub_cache.parents[3] / "acme").rmdir()
    capsys.readouterr()
    with_hub_snapshots(load_config(None, ["--model.path=acme/tiny"]))
    assert (f"raylm: model.path=acme/tiny is the hub's commit {REVISION} (the run's identity "
            f"records it; acme/tiny@{REVISION} pins it)") in capsys.readouterr().out
    with_hub_snapshots(load_config(None, [f"--model.path=acme/tiny@{REVISION}"]))
    assert "commit" not in capsys.readouterr().out


def test_revisions_are_names_and_code_is_never_fetched():
    from raylm.hub import FILES, HUB_ID

    assert HUB_ID.match("acme/tiny@v1.0") and HUB_ID.match(f"acme/tiny@{REVISION}")
    for bad in ("acme/tiny@..", "acme/tiny@.", "acme/tiny@../../x", "acme/tiny@a/b"):
        assert not HUB_ID.match(bad), bad
    from fnmatch import fnmatch

    for code in ("tokenizer.py", "tokenization_acme.py", "modeling_acme.py"):
        assert not any(fnmatch(code, pattern) for pattern in FILES), code
