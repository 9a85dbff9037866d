"""A run's last lines (raylm.run.launch.say_how_it_ended): a few a person reads, ending in the
commands to try next; the figures themselves are in summary.json. (The README tour runs the
printed next command.)"""

from __future__ import annotations

import pytest

from raylm.config import load_config
from raylm.contracts.summary import Summary
from raylm.run import tracking
from raylm.run.launch import next_commands, say_how_it_ended


def ending(cfg, summary, **kwargs) -> list[str]:
    lines: list[str] = []
    say_how_it_ended(cfg, summary, error=None, tracker=tracking.Tracker(), log=lines.append,
                     **kwargs)
    return lines


def finished(**fields) -> Summary:
    return Summary(**{"status": "finished", "invocation": "1", "final_step": 200,
                      "val_loss": 5.855809688568115, "checkpoint_path": "runs/tiny/checkpoint_x",
                      **fields})


def test_a_finished_run_ends_in_lines_naming_its_outcome_files_and_next_commands(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--run.name=tiny"])
    lines = ending(cfg, finished())
    assert lines == [
        "raylm: done: step 200, val loss 5.8558, 0 restarts, 0 resizes",
        "raylm: checkpoint runs/tiny/checkpoint_x",
        f"raylm: summary {tmp_path}/runs/tiny/summary.json (raylm train --json prints it too)",
        'raylm: next: raylm generate runs/tiny --prompt "The", or raylm export runs/tiny '
        '--output runs/tiny-hf']
    # A trial's ending is one line among the sweep's.
    assert ending(cfg, finished(), trial=True) == [
        f"raylm: done: step 200, val loss 5.8558, 0 restarts, 0 resizes, summary "
        f"{tmp_path}/runs/tiny/summary.json"]
    assert ending(cfg, finished(val_loss=None))[0].startswith(
        "raylm: done: step 200, no validation loss,")


@pytest.mark.parametrize("overrides, want", [
    (["--data.format=chat", "--model.path=models/base", "--lora.rank=8"],
     "raylm generate runs/chat --chat \"Hello\", or raylm export runs/chat --output "
     "runs/chat-hf --merge"),
    (["--run.storage_path=s3://bucket/runs"],
     "raylm generate s3://bucket/runs/chat --prompt \"The\", or raylm export "
     "s3://bucket/runs/chat --output chat-hf"),
    (["--run.storage_path=/elsewhere/my runs"],
     "raylm generate '/elsewhere/my runs/chat' --prompt \"The\", or raylm export "
     "'/elsewhere/my runs/chat' --output '/elsewhere/my runs/chat-hf'"),
])
def test_the_next_commands_fit_the_run(overrides, want, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--run.name=chat", *overrides])
    from raylm.config import run_dir

    assert next_commands(cfg, run_dir(cfg)) == want


def test_a_dpo_run_ends_with_its_accuracy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--run.name=dpo", "--train.objective=dpo",
                             "--data.format=preference", "--dpo.loss=simpo"])
    line = ending(cfg, finished(val_loss=0.41234, figures={"val_accuracy": 0.8125}))[0]
    assert line == ("raylm: done: step 200, val accuracy 0.812, val loss 0.4123, 0 restarts, "
                    "0 resizes")


def test_the_next_commands_outlive_a_removed_working_directory(tmp_path, monkeypatch):
    """A job's working directory can be gone by the time it ends: the run's path as given."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    cfg = load_config(None, ["--run.name=job", f"--run.storage_path={tmp_path}/runs"])
    gone.rmdir()
    from raylm.config import run_dir

    assert next_commands(cfg, run_dir(cfg)).startswith(f"raylm generate {tmp_path}/runs/job ")
