"""The README's tour, run end to end as a newcomer types it: every command of the tour in its
order, on a Ray head started with `ray start --head` on 127.0.0.1 with the machine's real 2
CPUs. (`make demo`, the default run, prepares the same builtin corpus as the tour's first
command; its run name, derived from the job, is checked in tests/unit/test_config.py.)

What differs from the page is what a test must change, each through a documented override:
the hub model (the network) becomes a raylm-made local model (`python -m
raylm.examples.reverse_words model`, as cpu_sft.yaml's header makes it), steps are 1/25 of the
page's, the sweep runs one trial (tests/integration/test_tune.py sweeps several) and prints its
best as JSON (`--json`), and the commands marked `# needs a cluster` are left to
tests/integration/test_jobs.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raylm.hub import HUB_ID
from tests.commands import page_commands
from tests.integration.heads import stop_own_head, wait_for_job_server
from tests.ranks import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HUB_MODEL = re.compile(r"--model\.path=(.+)$")
LOCAL_MODEL = "runs/reverse-init"


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """A reader's checkout (this repository's jobs/) with a home of its own, and a Ray head
    with 2 CPUs started there with `ray start --head` and Ray's defaults, after `make demo`:
    the home holds Ray's token (the demo's local `ray.init` wrote one), so Ray turns token
    authentication on, and every command joins the head `ray start` recorded, with nothing
    set (no RAY_ADDRESS, no RAY_AUTH_MODE)."""
    root = tmp_path_factory.mktemp("tour")
    (root / "jobs").symlink_to(ROOT / "jobs")
    (root / "home").mkdir()
    gcs, dashboard = free_port(), free_port()
    # Ray's temp directory of the reader's own (short: socket paths must fit 107 characters),
    # so the head recorded there is this one.
    temp = tempfile.mkdtemp(prefix="raytour-")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(PATH=f"{BIN}:{os.environ['PATH']}", HOME=str(root / "home"), RAY_TMPDIR=temp)
    subprocess.run([BIN / "ray", "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True)
    started = subprocess.Popen(
        [BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--num-cpus=2", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--temp-dir={temp}/ray", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_job_server(f"http://127.0.0.1:{dashboard}", started)
    # `ray start` records its head last, after the job server answers (as it returns).
    recorded = Path(temp) / "ray" / "ray_current_cluster"
    for _ in range(300):
        if recorded.exists() and recorded.read_text().strip():
            break
        time.sleep(0.1)
    assert recorded.read_text().strip(), f"`ray start` recorded no head in {recorded} in 30 s"
    yield {"root": root, "env": env}
    stop_own_head(started, temp)


def from_hub(word: str, root: Path) -> bool:
    """Whether ``word`` sets model.path to a hub id (an org/name that is no local directory)."""
    m = HUB_MODEL.match(word)
    return m is not None and HUB_ID.match(m.group(1)) is not None and not (
        root / m.group(1)).exists()


def as_tested(argv: list[str], root: Path) -> list[str]:
    """The page's command with the test's documented overrides (see the module doc)."""
    out = []
    for word in argv:
        if from_hub(word, root):
            word = f"--model.path={LOCAL_MODEL}"
        elif word.startswith("--train.steps="):
            word = f"--train.steps={max(2, int(word.split('=')[1]) // 25)}"
        elif word.startswith("--tune.num_samples="):
            word = "--tune.num_samples=1"
        out.append(word)
    if argv[:2] == ["raylm", "tune"]:
        out += ["--train.steps=4", "--train.eval_every=2", "--json"]
    if argv[0].startswith("python"):
        out[0] = sys.executable
    return out


def type_in(reader, argv: list[str], *, timeout: float = 600) -> str:
    done = subprocess.run([BIN / "raylm" if argv[0] == "raylm" else argv[0], *argv[1:]],
                          cwd=reader["root"], env=reader["env"], text=True,
                          capture_output=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_the_readme_tour_runs_as_written(reader):
    root = reader["root"]
    commands = [c for c in page_commands(ROOT / "README.md") if not c.inline]
    ran, outputs = [], {}
    for c in commands:
        if "a cluster" in c.needs:
            continue
        if any(from_hub(w, root) for w in c.argv):
            # The hub model's stand-in, made as cpu_sft.yaml's header makes it.
            type_in(reader, [sys.executable, "-m", "raylm.examples.reverse_words", "model",
                             "--data", "data/reverse", "--output", LOCAL_MODEL])
        argv = as_tested(c.argv, root)
        outputs[c.where] = type_in(reader, argv)
        ran.append(c.where)
        if argv[:3] == ["raylm", "generate", "runs/sft-merged"] and "--chat" in argv:
            chat = (argv[argv.index("--chat") + 1], outputs[c.where])
    assert len(ran) >= 9, ran
    # The SFT run's export answers a plain transformers client that renders the conversation
    # with the export's chat template as `raylm generate --chat` answered.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = str(root / "runs" / "sft-merged")
    tok, model = AutoTokenizer.from_pretrained(merged), AutoModelForCausalLM.from_pretrained(merged)
    prompt = tok.apply_chat_template([{"role": "user", "content": chat[0]}],
                                     add_generation_prompt=True, return_dict=False,
                                     return_tensors="pt")
    with torch.no_grad():
        answer = model.generate(prompt, max_new_tokens=64, do_sample=False)
    plain = tok.decode(answer[0, prompt.shape[1]:], skip_special_tokens=True).removeprefix(" ")
    assert plain and chat[1].startswith(plain + "\n"), (plain, chat[1][:500])
    text = "\n".join(outputs.values())
    # A run ends in a few lines a person reads, the last the commands to try next; the first
    # of them runs as printed.
    first = next(iter(outputs.values())).splitlines()
    done = next(i for i, line in enumerate(first) if line.startswith("raylm: done: step 4,"))
    hint = next(line for line in first[done:done + 6] if line.startswith("raylm: next: "))
    generate = shlex.split(hint.removeprefix("raylm: next: ").split(", or ")[0])
    assert generate[:3] == ["raylm", "generate", "runs/cpu-tiny"], hint
    assert type_in(reader, [*generate, "--max-new-tokens", "4"]).startswith("The")
    # The second pretraining command resumed the first; every run had a directory of its own.
    assert "raylm: run 'cpu-tiny' exists; resuming from step 4 of 8" in text
    # Every run joined the reader's head, which `ray start` recorded, with its token.
    assert text.count("(the head `ray start` runs on this machine)") == 5, text
    # The device, said first: auto found no GPU on this cluster.
    assert "raylm: workers on CPUs: scaling.use_gpu=auto and the cluster has no GPU" in text
    assert json.loads((root / "runs" / "cpu-tiny" / "summary.json").read_text())[
        "device"].startswith("workers on CPUs")
    for name, step in (("cpu-tiny", 8), ("sft", 12), ("dpo", 4)):
        summary = json.loads((root / "runs" / name / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["final_step"] == step, name
    best = json.loads((root / "runs" / "lr-sweep" / "tune_summary.json").read_text())["best"]
    # With --json, the sweep's best trial follows its last lines on stdout, for a script.
    (sweep,) = [out for out in outputs.values() if "raylm: sweep done" in out]
    lines = sweep.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    printed, _ = json.JSONDecoder().raw_decode("\n".join(lines[start:]))
    assert best and printed["trial_id"] == best["trial_id"], sweep[-3000:]
    assert (root / "runs" / "sft-merged" / "config.json").is_file()
    # A dry run reads the run directory as the run would: finished, or another model's. (The
    # two side by side: each is a fresh interpreter's imports, on one core.)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        finished = pool.submit(type_in, reader, ["raylm", "train", "--config",
                                                 "jobs/configs/cpu_tiny.yaml", "--train.steps=8",
                                                 "--dry-run"])
        other = pool.submit(subprocess.run, [
            BIN / "raylm", "train", "--config", "jobs/configs/cpu_tiny.yaml",
            f"--model.path={LOCAL_MODEL}", "--dry-run"], cwd=root, env=reader["env"], text=True,
            capture_output=True, timeout=300).result()
        done = finished.result()
    assert "raylm: dry run: run: runs/cpu-tiny has trained its 8 steps already" in \
        done.replace(str(root) + "/", "")
    assert other.returncode == 2
    assert "was trained with other model.path than this run has" in other.stderr
    # Nothing of raylm's reached the console as an error. (Ray Train's placement-group
    # cleaner, a detached helper, once printed a traceback of its own monitoring thread here,
    # its cause not kept; it is Ray's, and the run it watched ended well. And a finished Tune
    # trial's process still ending when `raylm tune` exits is ended by Ray with SIGTERM, whose
    # handler raises SystemExit wherever the process is: once inside a garbage collector's
    # callback, which Python printed as a traceback. That process's lines name the handler.)
    assert "Failed to query Ray Train Controller" not in text
    lines = text.splitlines()
    ended = {line.split(")", 1)[0] for line in lines
             if line.startswith("(") and line.endswith("in sigterm_handler")}
    ours = [line for line in lines if "Traceback" in line
            and not line.startswith("(PlacementGroupCleaner")
            and not (line.startswith("(") and line.split(")", 1)[0] in ended)]
    assert not ours, text
