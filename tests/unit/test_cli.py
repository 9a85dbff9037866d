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
    # A sequence split over workers: its shards, and what attention holds of it (the tiny
    # preset: 4 heads of 16, 256 tokens in fp32: 32 KB for q, k, v and the output each).
    assert main(["train", "--dry-run", "--parallel.context=2", "--scaling.num_workers=2",
                 "--scaling.use_gpu=false", "--train.precision=fp32",
                 "--run.ray_address=local", "--tracking.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert "workers: 2 x 1 CPU, parallel.context=2, each with" in out
    assert ("context: each sequence's 256 tokens over 2 workers (parallel.context=2), 128 "
            "each; inside attention each holds the whole sequence for 2 of 4 heads: q, k, v "
            "and the output 0.1 MB per block and sequence" in out)
    assert main(["train", "--dry-run", "--parallel.context=3", "--scaling.num_workers=3",
                 "--data.seq_len=255"]) == 2
    assert "parallel.context=3 does not divide the model's 4 attention heads" in (
        capsys.readouterr().err)
    # GRPO: where it samples, and what the copies of its weights cost (the tiny preset's
    # 1.18 M parameters in fp32 are 4.7 MB; three versions kept by the object store).
    (tmp_path / "q.jsonl").write_text('{"prompt": "1 + 2?", "answer": "3"}\n')
    grpo = ["train", "--dry-run", "--train.objective=grpo", "--data.format=prompt",
            "--rl.reward=final_number", "--data.source=q.jsonl", "--train.precision=fp32",
            "--run.ray_address=local", "--tracking.enabled=false"]
    assert main([*grpo, "--rl.max_staleness=2"]) == 0
    assert ("generation: 1 generator actor(s) of {'CPU': 1.0}, each holding the model (4.7 "
            "MB); the object store keeps up to 3 version(s) of the trainable weights, 14.2 MB"
            in capsys.readouterr().out)
    assert main([*grpo, "--rl.generators=0", "--rl.kl_coef=0.1"]) == 0
    assert ("generation: colocated (rl.generators=0): each trainer samples its own share with "
            "its own model, gathered whole while it samples (4.7 MB), beside a frozen copy "
            "for the KL reference (4.7 MB)" in capsys.readouterr().out)


EXITING = """
import atexit, sys, threading, time
from raylm import cli
atexit.register(lambda: print("exit handler ran", flush=True))
if "--thread" in sys.argv:
    def late():
        time.sleep(0.5)
        print("thread ended", flush=True)
    threading.Thread(target=late).start()
cli.run([a for a in sys.argv[1:] if a != "--thread"])
"""


@pytest.mark.parametrize(("command", "code", "said"), [
    (["config"], 2, "the following arguments are required"),  # argparse's own exit
    (["--version"], 0, f"raylm {raylm.__version__}"),
    (["export", "runs/x", "--output", "runs/y", "--train.steps=3"], 2,
     "raylm: error: raylm export takes no config overrides"),  # main's own refusal
])
def test_the_command_as_a_process_keeps_its_code_output_and_exit_handlers(command, code, said):
    """`raylm` as a process (the console script) ends without the interpreter's teardown: its
    exit code, every line it printed (a pipe, not a terminal) and the exit handlers remain,
    and a thread Python would wait for is waited for."""
    import subprocess
    import sys

    for extra in ([], ["--thread"]):
        p = subprocess.run([sys.executable, "-c", EXITING, *command, *extra],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == code, p.stderr
        assert said in p.stdout + p.stderr
        assert p.stdout.rstrip().endswith("exit handler ran"), p.stdout
        assert ("thread ended" in p.stdout) == bool(extra)
