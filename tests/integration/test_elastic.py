"""Elastic training on a cluster of several Ray nodes on one machine: a node is removed mid-run
and the run goes on with the worker that is left; a node is added and it grows back; a node
drained as a cloud reclaiming it would drain it: the run checkpoints at once and goes on from
there on the other node. One run goes through all three, since each worker group start costs
~20 s here. A reinforcement-learning run (GRPO) learns its task on the same cluster while
losing a generator and then a trainer's node."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raylm.config import load_config
from raylm.contracts.events import Failure, GroupStart, Placing, Progress
from raylm.data.preparation import prepare
from raylm.run import record
from raylm.run.launch import train
from tests.conftest import (
    PIECE_MB,
    names_of_cb5e3f1,
    names_since_cb5e3f1,
    tiny_run,
    write_pieces_corpus,
)
from tests.integration import faults

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    """A head (controller, data readers, RL generators) and two 1-CPU nodes that each hold one
    training worker: the workers ask for the custom resource `trainer` that only those nodes
    have, and the GRPO run's generators for `generator`, which only the head has."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                      "resources": {"generator": 2}})
    nodes = [c.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def wait_for(predicate, what: str, timeout: float = 180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_preparation_on_three_nodes_equals_one_cpu_byte_for_byte(request, tmp_path,
                                                                 tokenizer_dir):
    """The same corpus, in six preparation pieces, prepared on a 1-CPU cluster (started here,
    before this module's cluster) and on this module's three nodes: the same files, byte for
    byte."""
    import ray

    write_pieces_corpus(tmp_path / "corpus")
    cfg = load_config(None, [
        f"--data.source={tmp_path / 'corpus'}", f"--tokenizer.path={tokenizer_dir}",
        "--data.seq_len=31", "--data.rows_per_row_group=16", "--data.val_fraction=0.1",
        f"--data.piece_mb={PIECE_MB}", f"--run.cache_dir={tmp_path}/cache"])
    said: dict[str, list[str]] = {"one": [], "three": []}
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        prepare(cfg, tmp_path / "one", log=said["one"].append)
    finally:
        ray.shutdown()
    request.getfixturevalue("cluster")
    prepare(cfg, tmp_path / "three", log=said["three"].append)
    assert said["one"][-1].endswith("6 pieces packed on 1 node")
    # SPREAD is Ray's best effort: on a loaded machine a node that is busy starting a worker
    # process can be passed over, so the six pieces may land on two of the three nodes. Either
    # way the pieces were made on several nodes, which is what the bytes are compared across.
    assert said["three"][-1].endswith(("6 pieces packed on 3 nodes",
                                       "6 pieces packed on 2 nodes"))

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file()}

    one_files, three_files = files(tmp_path / "one"), files(tmp_path / "three")
    assert len(one_files) > 6 and one_files == three_files


def test_node_lost_added_back_then_drained(cluster, tmp_path, tokenizer_dir, monkeypatch):
    """Two workers, elastic between 1 and 2, on the two trainer nodes. One node is lost: the
    run goes on with the worker that is left, from its last checkpoint. A node is added: the
    run grows back to two. Then a node is drained as a cloud reclaiming it drains it (`ray
    drain-node` with the preemption reason and a deadline): the group saves at the step it has
    reached, so no step is trained twice, and goes on on the other node once the drained one
    is gone. Every sample of the seed's order is trained once, in order. (That a preempted
    group's restart ends with an uninterrupted run's losses is shown in test_train.)"""
    import ray
    from ray._private.state import available_resources_per_node


    c, nodes = cluster
    # After the node is lost, Ray Train first waits this long (60 s by default) for the
    # placement group of a group of the old size before the elastic policy settles for fewer
    # workers; a group of one is placed at once.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "4")
    # Ray Train's poll at Ray's 2 s (one pending report per worker; raylm would poll every
    # 0.5 s) paces this run at one checkpoint's report per poll (a report with a checkpoint is
    # never held back), so it is still going when the node comes back (the resize came at step
    # 40-65 of 120) and when the drain comes (step 56-78). Drains are looked for every 0.5 s
    # instead of 5.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    cfg = load_config(None, [
        *tiny_run(tmp_path, tokenizer_dir), "--run.name=elastic",
        "--train.global_batch_size=8", "--train.micro_batch_size=2",
        "--train.steps=120", "--train.log_every=5", "--train.eval_every=100",
        "--train.eval_batches=2", "--checkpoint.every=5", "--optim.lr=3e-3",
        "--scaling.num_workers=[1,2]", "--scaling.worker_resources={trainer: 1}",
        "--scaling.resize_interval_s=2", "--tracking.enabled=false"])
    run_dir = tmp_path / "runs" / "elastic"
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(summary=train(cfg, log=print)),
                              daemon=True)
    thread.start()

    def checkpoint_step():
        return faults.checkpoint_step(run_dir)

    def groups():
        return [e for e in record.read(str(run_dir)) if isinstance(e, GroupStart)]

    wait_for(lambda: checkpoint_step() >= 5 and groups(),
             "the first checkpoint of 2 workers, and the controller to know of the group")
    c.remove_node(nodes[1])
    wait_for(lambda: [e for e in groups() if e.workers == 1],
             "the run to continue on 1 worker")
    c.add_node(num_cpus=1, resources={"trainer": 1})
    wait_for(lambda: len(g := groups()) >= 3 and checkpoint_step() > g[2].from_step,
             "a checkpoint of the group grown back to 2 workers")
    # Both trainer nodes hold a worker now (a resource with nothing free is left out of the
    # node's available resources); drain one of them.
    free = available_resources_per_node()
    busy = [x["NodeID"] for x in ray.nodes() if x["Alive"] and x["Resources"].get("trainer")
            and free.get(x["NodeID"], {}).get("trainer", 0) == 0]
    assert len(busy) == 2, busy
    drain = subprocess.run(
        [Path(sys.executable).parent / "ray", "drain-node", "--address", c.address,
         "--node-id", busy[0], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds",
         "120"], capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    # Ray Train's elastic policy still counts a draining node's resources (measured: it tried
    # groups of 2 every 4 s for minutes), so the run goes on once the node is gone, as the
    # cloud takes it at its deadline.
    wait_for(lambda: len([e for e in record.read(str(run_dir)) if isinstance(e, Failure)]) >= 2,
             "the drained group to stop")
    c.remove_node(next(n for n in c.worker_nodes if n.node_id == busy[0]))
    thread.join(300)
    assert "summary" in out, "the run did not finish"
    s = out["summary"]
    assert s["status"] == "finished" and s["final_step"] == 120 and s["workers"] == 1
    shrink, grow, drained = s["interruptions"]
    assert (shrink["event"], shrink["from_workers"], shrink["to_workers"]) == ("restart", 2, 1)
    assert (grow["event"], grow["from_workers"], grow["to_workers"]) == ("resize", 1, 2)
    assert (drained["event"], drained["from_workers"], drained["to_workers"]) == (
        "restart", 2, 1)
    assert s["restarts"] == 2 and s["resizes"] == 3
    # The first group placed after the loss was of the 1 worker that fits: the elastic policy
    # saw the lost node gone at the restart (raylm's FreshClusterView), rather than asking
    # again for 2 until Ray's view of the nodes caught up.
    records = record.read(str(run_dir))
    lost_at = next(i for i, e in enumerate(records) if isinstance(e, Failure))
    assert next(e for e in records[lost_at:] if isinstance(e, Placing)).workers == 1
    for e in (shrink, grow):
        assert e["resumed_from_step"] % 5 == 0 and e["time_lost_s"] >= 0
        assert 0 <= e["steps_redone"] < 5 + 5  # at most a checkpoint interval plus a report's
    assert "node drain" in drained["cause"] and "draining" in drained["cause"]
    assert drained["steps_redone"] == 0
    assert drained["resumed_from_step"] == drained["at_step"] > grow["resumed_from_step"]
    assert s["samples"] == {"steps": 120, "trained": 960, "duplicated": 0, "skipped": 0,
                            "withheld": 0, "in_order": True, "left_out": 0}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """The task's prompts and its tiny model, taught in this process to answer with one of
    the question's two digits at random (:mod:`raylm.examples.larger_digit`)."""
    from raylm.examples.larger_digit import write

    root = tmp_path_factory.mktemp("rl")
    write(root)
    return root


def test_grpo_learns_loses_a_generator_then_a_trainer_node_and_resumes_on_one_exactly(
        cluster, warmed, tmp_path, monkeypatch):
    """GRPO, off-policy (one step ahead) with two updates a step, on two trainers between 1 and
    2 workers: a model warmed up on the task's format learns the task from its rewards. A
    generator killed as the run starts is replaced while the trainers go on (rl.generators
    [1, 2]: the other takes its share meanwhile); a trainer's node lost after a checkpoint
    leaves one worker, which resumes to the same rewards and losses, training the completions
    the checkpoint kept. The prompts are prepared first and their source rewritten after, every
    answer the wrong digit: the run reads the rows its prepared blocks keep, nothing else."""
    import json

    import ray

    from raylm import api
    from raylm.run.launch import train

    c, _ = cluster
    while len(c.worker_nodes) < 2:  # the test before leaves one trainer node
        c.add_node(num_cpus=1, resources={"trainer": 1})
    c.wait_for_nodes()
    # Ray Train sizes the first group by Ray Data's autoscaling coordinator's view of the
    # nodes, read every 20 s; a node added just now would be missed, and the group start
    # with one worker. Read it again now, as raylm's restarts have it do (FreshClusterView).
    with contextlib.suppress(ValueError):  # no coordinator yet: it reads the nodes as it starts
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(coordinator.get_reserved_resources.remote("raylm", recompute=True))
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "4")

    source = tmp_path / "prompts.jsonl"
    source.write_text((warmed / "prompts.jsonl").read_text())
    settings = [
        f"--model.path={warmed / 'model'}",
        "--data.format=prompt", "--train.objective=grpo", "--rl.reward=exact_match",
        "--data.seq_len=40", "--rl.max_completion_tokens=4", "--rl.group_size=8",
        "--rl.generators=[1, 2]", '--rl.generator_resources={"CPU": 0.5, "generator": 1}',
        "--rl.max_staleness=1",
        "--rl.updates_per_step=2", "--rl.kl_coef=0.05",
        "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.steps=100",
        "--train.log_every=1", "--train.eval_every=20", "--train.eval_batches=4",
        "--checkpoint.every=20", "--optim.lr=1e-3", "--optim.warmup_steps=2",
        "--train.precision=fp32", "--data.val_fraction=0.2", "--scaling.num_workers=[1, 2]",
        "--scaling.worker_resources={trainer: 1}",
        f"--run.storage_path={tmp_path}/runs", f"--run.cache_dir={tmp_path}/cache",
        "--run.name=grpo", "--tracking.enabled=true",
        f"--tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--tracking.log_model=false"]
    prepare(load_config(None, [*settings, f"--data.source={source}"]), tmp_path / "prepared",
            log=print)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    source.write_text("".join(json.dumps({**r, "answer": next(
        c for c in r["prompt"][0]["content"] if c.isdigit() and c != r["answer"])}) + "\n"
        for r in rows))
    cfg = load_config(None, [*settings, f"--data.source={tmp_path / 'prepared'}"])
    run_dir = tmp_path / "runs" / "grpo"

    killed_after: list[int] = []
    generators: dict[str, set[str]] = {}

    def alive_generators() -> dict[str, str]:
        from ray.util.state import list_actors

        return {a.actor_id: a.node_id for a in list_actors(filters=[
            ("class_name", "=", "GeneratorActor"), ("state", "=", "ALIVE")], limit=100)}

    def kill_a_generator_then_a_trainer_node() -> None:
        """A generator as soon as the group has started; then a trainer's node, once the
        record holds a step after the newest checkpoint, the trainers stopped so that no save
        lands meanwhile (the lost node's raylet kills its worker, stopped or not). From the
        first checkpoint on, the trainers are held (:func:`faults.hold_until`): at 50 ms a
        step the record would lag past the next checkpoint. The generators alive then on
        other nodes are looked for again once the resumed group has trained a step."""
        (victim, *_) = faults.generator_processes()
        victim.send_signal(signal.SIGKILL)
        wait_for(lambda: faults.checkpoint_step(run_dir) > 0, "the first checkpoint")

        def reported_past_the_checkpoint() -> bool:
            reported = max((r.step for r in record.read(str(run_dir))
                            if isinstance(r, Progress)), default=0)
            return faults.checkpoint_step(run_dir) < reported < 100

        trainers = faults.hold_until(reported_past_the_checkpoint,
                                     what="a step reported after a checkpoint")
        killed_after.append(faults.checkpoint_step(run_dir))
        lost = next(iter(c.worker_nodes))
        generators["elsewhere"] = {a for a, node in alive_generators().items()
                                   if node != lost.node_id}
        c.remove_node(lost)
        faults.signal_all(trainers, signal.SIGCONT)

        def resumed_a_step() -> bool:
            records = list(record.read(str(run_dir)))
            starts = [i for i, r in enumerate(records) if isinstance(r, GroupStart)]
            return len(starts) > 1 and any(isinstance(r, Progress) for r in records[starts[1]:])

        wait_for(resumed_a_step, "a step of the resumed group")
        generators["resumed"] = set(alive_generators())

    summary = faults.run_and_interfere(lambda: train(cfg, log=print), run_dir,
                                       acts=[(0, kill_a_generator_then_a_trainer_node)])
    assert summary["status"] == "finished" and summary["final_step"] == 100
    assert summary["restarts"] == 1  # the node's loss; the generator's cost no restart
    (restart,) = [i for i in summary["interruptions"] if i["event"] == "restart"]
    (k,) = killed_after
    assert restart["resumed_from_step"] == k
    assert (restart["from_workers"], restart["to_workers"], summary["workers"]) == (2, 1, 1)
    # The generators are the driver's (raylm.rollout.keeper), on the head (the `generator`
    # resource): those alive as the node went served the resumed group, the same actors.
    assert generators["elsewhere"] and generators["elsewhere"] <= generators["resumed"], \
        generators
    groups: list[dict[int, dict]] = []
    for r in record.read(str(run_dir)):
        if isinstance(r, GroupStart):
            groups.append({})
        elif isinstance(r, Progress):
            groups[-1][r.step] = r.history()
    first, second = groups
    assert max(r["rl_generators_replaced"] for r in first.values()) >= 1
    # ... and the restart replaced none of them (the count runs across the group's restarts).
    assert min(r["rl_generators_replaced"] for r in second.values()) == max(
        r["rl_generators_replaced"] for r in first.values())
    # rl.generators=[1, 2]: the steps went on with one while the lost one's replacement
    # started, and the run ended with two.
    assert min(r["rl_generators"] for r in first.values()) == 1
    assert second[100]["rl_generators"] == 2
    again = sorted(set(first) & set(second))
    assert again and again[0] == k + 1, (k, sorted(first), sorted(second))
    # Off-policy (rl.max_staleness=1): step k + 1 trains the completions version k - 1
    # sampled, which the resumed group, holding version k, has only from the checkpoint.
    assert second[k + 1]["rl_weight_version_min"] == k - 1
    assert second[k + 1]["rl_staleness_max"] == 1
    # The same completions, rewards and update from the step-k weights, on one worker as on
    # two (each worker's share of the step's groups is summed over the workers).
    for step in again:
        for key in ("rl_reward", "rl_completion_len", "loss"):
            assert second[step][key] == pytest.approx(first[step][key], abs=1e-6), (step, key)
    assert summary["samples"]["duplicated"] == 0 and summary["samples"]["skipped"] == 0
    # Two updates a step (rl.updates_per_step=2): the second trains completions the first
    # moved the policy from, and the clip binds on some of their tokens.
    path = [second.get(step, first.get(step)) for step in range(1, 101)]
    assert max(r["rl_clip_low"] + r["rl_clip_high"] for r in path) > 0
    # The KL penalty of a full fine-tune (rl.kl_coef=0.05): the generators score the starting
    # weights, which the policy moves away from, and the checkpoint keeps those scores.
    assert path[0]["rl_kl"] < 0.01 < max(r["rl_kl"] for r in path)
    assert summary["samples"]["trained"] == 100 * 8
    assert names_since_cb5e3f1(summary, run_dir) == names_of_cb5e3f1("grpo")
    # It learned: from about half right (either digit of the question, at random) to the
    # larger one, on the training prompts and on held-out ones.
    rewards = [r["rl_reward"] for r in path]
    assert sum(rewards[:5]) / 5 < 0.65 and sum(rewards[-10:]) / 10 >= 0.8, rewards
    assert summary["val_reward"] >= 0.8
    history = api.Run(str(run_dir)).history
    assert {"rl_reward", "rl_reward_std", "rl_no_signal", "rl_clip_low", "rl_kl",
            "rl_generate_s", "rl_transfer_s", "val_reward"} <= set(history)
    assert "rl_reward" in summary and "rl_clip_high" in summary
    causes = summary["goodput"]["seconds"]
    assert causes["generation"] > 0 and causes["weight_transfer"] > 0, causes
    from mlflow import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    for name in ("rl_reward", "rl_truncated", "val_reward"):
        assert client.get_metric_history(summary["mlflow_run_id"], name), name
    # tokens_seen counts the rows trained, prompt and completion (the task's prompts all have
    # one length): 100 steps of 64 rows less their completions leave 6,400 such prompts.
    seen = max(client.get_metric_history(summary["mlflow_run_id"], "tokens_seen"),
               key=lambda m: m.step).value
    completions = 64 * sum(second.get(s, first.get(s))["rl_completion_len"]
                           for s in range(1, 101))
    prompt_len = (seen - completions) / 6400
    assert prompt_len > 5 and prompt_len == pytest.approx(round(prompt_len), abs=1e-6), prompt_len
