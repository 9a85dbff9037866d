"""What raylm reads back from a run directory is data: a run directory planted by someone who
can write it (the threat docs/fault-tolerance.md names) must not choose where raylm connects
or what code it imports. Each test plants a field into a real run directory (the one raylm
wrote at 6ef9b7a, tests/fixtures) and shows it is refused or harmless."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

from raylm import rundir
from raylm.cli import main
from raylm.contracts import EVENTS, LEASE, MLFLOW_RUN, RUN_INFO, SKIPPED, SUMMARY
from raylm.run import tracking

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "run-6ef9b7a"


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of a run directory raylm wrote, in a runs/ folder of its own."""
    return Path(shutil.copytree(RUN, tmp_path / "runs" / RUN.name))


def plant(path: Path, **fields) -> None:
    """Set ``fields`` (``section__key`` for run.json's config) in a JSON file of the run."""
    data = json.loads(path.read_text())
    for name, value in fields.items():
        if "__" in name:
            section, key = name.split("__")
            data["config"][section][key] = value
        else:
            data[name] = value
    path.write_text(json.dumps(data))


def test_eval_imports_no_task_code_a_run_directory_names(run, tmp_path, capsys):
    """run.json's eval settings name a task folder whose YAML calls a function of a module
    beside it (lm-eval imports it while loading the task): `raylm eval RUN` without its own
    --eval.include_path refuses in one line, before it looks for a checkpoint to score, and
    the module never runs. (At 6ef9b7a the run's settings were taken whole: scoring a
    checkpoint imported p.py.)"""
    tasks = tmp_path / "planted"
    tasks.mkdir()
    ran = tmp_path / "ran"
    (tasks / "p.py").write_text(f"open({str(ran)!r}, 'w').close()\ndef f(doc):\n    return ''\n")
    (tasks / "planted.yaml").write_text(
        "task: planted\ndataset_path: json\noutput_type: generate_until\n"
        "doc_to_text: !function p.f\ndoc_to_target: ''\n")
    plant(run / "run.json", eval__tasks=["planted"], eval__include_path=str(tasks))
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"eval.include_path={tasks}" in line and "--eval.include_path=FOLDER" in line, line
    assert not ran.exists()


def test_a_finished_runs_mlflow_store_is_the_users_never_the_run_directorys(
        run, tmp_path, monkeypatch):
    """summary.json and run.json name an MLflow server (a listener on loopback here) while the
    user's shell holds MLflow credentials: `raylm eval` and `raylm prune` get a tracker that
    logs nothing, say why in one line, and nothing connects to the listener. The store the
    user names (MLFLOW_TRACKING_URI) or the default one beside the run is used when the run's
    record names that one."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    planted = f"http://127.0.0.1:{listener.getsockname()[1]}"
    connected: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            connected.append(conn.recv(65536))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "user")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    plant(run / "run.json", tracking__enabled=True, tracking__uri=planted)
    plant(run / "summary.json", mlflow_run_id="0" * 32, mlflow_tracking_uri=planted)
    said: list[str] = []
    summary = rundir.read_summary(str(run))
    tracker = tracking.run_tracker(str(run), summary, log=said.append)
    tracker.log_pruning({"step": 4, "val_loss": 1.0, "method": "magnitude"})
    tracker.log_scores({"eval/x/acc": 1.0}, 4)
    stop.set()
    thread.join()
    listener.close()
    assert not isinstance(tracker, tracking.MLflowTracker) and connected == []
    (line,) = said
    assert planted in line and "MLFLOW_TRACKING_URI" in line and "secret" not in line
    # Where the record names the store the user would log to, that store is used.
    beside = f"sqlite:///{run.parent}/mlflow.db"
    summary.mlflow_tracking_uri = beside
    assert tracking.run_tracker(str(run), summary, log=said.append).uri == beside
    monkeypatch.setenv("MLFLOW_TRACKING_URI", planted)
    summary.mlflow_tracking_uri = planted
    assert tracking.run_tracker(str(run), summary, log=said.append).uri == planted
    assert len(said) == 1


@pytest.mark.parametrize("name", [RUN_INFO, SUMMARY, MLFLOW_RUN, SKIPPED, EVENTS, LEASE])
def test_no_write_in_a_run_directory_follows_a_link(run, tmp_path, name):
    """Each file of the run directory that raylm writes, planted as a link to a file outside
    it: the write replaces the link (or, for the appended event log, is refused), and the
    file outside is unchanged."""
    from raylm import storage
    from raylm.run.lease import Lease

    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own file")
    link = run / name
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    if name == EVENTS:
        with pytest.raises(OSError):
            storage.append_text(str(link), '{"event": "end"}\n')
        assert link.is_symlink()
    elif name == LEASE:
        lease = Lease(str(run), log=lambda m: None).take()
        assert not link.is_symlink()
        lease.release()
    else:
        storage.write_text(str(link), "{}")
        assert not link.is_symlink() and link.read_text() == "{}"
    assert outside.read_text() == "the user's own file"


def test_a_linked_tokenizer_folder_is_refused_before_anything_in_it_is_removed(run, tmp_path):
    """RUN/tokenizer, which raylm empties when the run's tokenizer changed, planted as a link
    to another folder: refused in one line, that folder untouched."""
    from raylm.formats.exporter import write_run_info

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("kept")
    shutil.rmtree(run / "tokenizer", ignore_errors=True)
    (run / "tokenizer").symlink_to(other)
    with pytest.raises(ValueError, match="tokenizer is a link; remove it"):
        write_run_info(str(run), config={}, vocab_size=1, eos_id=0,
                       tokenizer_path=str(tmp_path), prepared="")
    assert [p.name for p in other.iterdir()] == ["keep.txt"]


def test_ray_trains_record_of_checkpoints_names_nothing_outside_the_run(run, tmp_path, capsys):
    """Ray Train's record of the checkpoints it keeps (RUN/checkpoint_manager_snapshot.json,
    read back when a run starts; the oldest names beyond checkpoint.keep are deleted wherever
    they point, and pyarrow deletes `RUN/../x`) planted with a folder outside the run: the
    resume is refused in one line naming it, and the folder is untouched. A record in Ray's
    own shape, naming the run's checkpoint, passes."""
    from raylm.contracts import RAY_TRAIN_STATE
    from raylm.rundir import CheckpointError, check_ray_state

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("kept")
    kept = {"checkpoint_dir_name": "checkpoint_000004", "metrics": {"step": 4}}
    record = {"ray_version": "2.60.0", "checkpoint_results": [kept],
              "checkpoint_report_indices": [1], "latest_checkpoint_result": kept,
              "pending_training_results": [], "pending_validation_specs": [],
              "current_report_index": 2, "validated_checkpoint_dir_names": []}
    (run / RAY_TRAIN_STATE).write_text(json.dumps(record))
    check_ray_state(str(run))
    for name in ("../../victim", str(victim), "checkpoint_000004/../../../victim"):
        planted = {**record, "checkpoint_results": [{**kept, "checkpoint_dir_name": name}, kept],
                   "validated_checkpoint_dir_names": [name]}
        (run / RAY_TRAIN_STATE).write_text(json.dumps(planted))
        with pytest.raises(CheckpointError, match="which is not a checkpoint folder's name") as e:
            check_ray_state(str(run))
        assert repr(name) in str(e.value) and "\n" not in str(e.value)
    # Through the command: refused in one line before Ray starts.
    config = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "cpu_tiny.yaml"
    capsys.readouterr()
    assert main(["train", "--config", str(config), f"--run.storage_path={run.parent}",
                 f"--run.name={run.name}", "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "checkpoint_manager_snapshot.json" in line and "victim" in line, line
    (run / RAY_TRAIN_STATE).write_text("{not json")
    with pytest.raises(CheckpointError, match="'\\(not JSON\\)'"):
        check_ray_state(str(run))
    assert (victim / "keep.txt").read_text() == "kept"


def test_a_linked_benchmarks_folder_holds_nothing_outside_the_run(run, tmp_path):
    """RUN/.benchmarks, where a checkpoint's files are hard-linked while its benchmark waits
    (and which raylm empties after), planted as a link to another folder: nothing is linked
    or removed there; the evaluation reads the checkpoint itself."""
    from raylm.contracts import BENCHMARKS
    from raylm.run.benchmarks import hold

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("kept")
    (run / BENCHMARKS).symlink_to(other)
    checkpoint = str(run / "checkpoint_000004")
    assert hold(str(run), checkpoint, 4) == checkpoint
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
