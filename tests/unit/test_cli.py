"""The ``raylm`` command's own surface: its version, help that shows defaults, and config
overrides refused where they would change nothing."""

from __future__ import annotations

import pytest

import raylm
from raylm.cli import main


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"raylm {raylm.__version__}"


def test_help_shows_each_default_worth_saying(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 64)", "(default: 0.8)", "(default: 0)"):
        assert shown in text
    # An empty prompt, an unset system message and an off switch have nothing to say.
    assert "(default: )" not in text and "(default: None)" not in text
    assert "(default: False)" not in text


@pytest.mark.parametrize("argv", [
    ["export", "runs/x", "--output", "runs/y", "--train.steps=3"],
    ["generate", "runs/x", "--prompt", "a", "--model.preset", "small"],
    ["jobs", "list", "--run.name=other"],
])
def test_overrides_that_a_command_would_ignore_are_refused(argv, capsys, ray_never_starts):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raylm: error: raylm {argv[0]} takes no config overrides")
    assert err.count("\n") == 1


def test_a_dry_run_preflights_and_says_what_would_run_where(capsys, ray_never_starts,
                                                            tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "--dry-run", "--scaling.use_gpu=false", "--train.steps=3",
                 "--run.ray_address=local", "--tracking.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert "name: tiny-builtin\n" in out  # the resolved config first
    lines = [s.removeprefix("raylm: dry run: ") for s in out.splitlines()
             if s.startswith("raylm: dry run: ")]
    assert lines[0] == "cluster: a new local Ray cluster on this machine"
    assert lines[1] == "device: workers on CPUs (scaling.use_gpu=false)"
    assert lines[2].startswith("workers: 1 x 1 CPU, each with a data reader of 0.1")
    assert lines[3].startswith("data: ") and " files of text, " in lines[3]
    assert lines[4] == f"run: a new run in {tmp_path}/runs/tiny-builtin (run.name=tiny-builtin)"
    assert lines[-2:] == ["tracking: off (tracking.enabled=false)",
                          "the preflight passed; nothing was started"]
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    # A sweep of the same job gets its own directory; a refusal is the run's own.
    assert main(["tune", "--dry-run", "--train.eval_every=50", "--run.ray_address=local",
                 "--tracking.enabled=false"]) == 0
    assert f"run: a new sweep in {tmp_path}/runs/tiny-builtin-sweep" in capsys.readouterr().out
    assert main(["train", "--dry-run", "--data.seq_len=4096"]) == 2
    assert "data.seq_len=4096 is above the 1024 positions" in capsys.readouterr().err
