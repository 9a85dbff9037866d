"""Pipeline parallelism: 2 gloo processes at pp 2, under each schedule, match a single-process
reference (fp32, CPU), no Ray: gradients of one step, AdamW steps, masked fine-tuning steps,
evaluation, LoRA on a pretrained base, and a checkpoint saved by the stages that loads into
the whole model."""

from __future__ import annotations

import pytest
import torch

from raylm.config import PIPELINE_SCHEDULES
from raylm.model.parallelize import DATA_PARALLEL, ParallelPlan, layout_of
from raylm.model.pipeline import describe_split, stage_layers
from tests.distributed.shared import (
    BATCH,
    LORA,
    VOCAB,
    data,
    masked_data,
    reload,
    save_pretrained,
    whole,
    worker,
)
from tests.ranks import free_port, run_ranks

STEPS = 3
SCHEDULES = PIPELINE_SCHEDULES


def halves(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of the batch's rows (a pipeline needs at least one per stage)."""
    half = BATCH // 2
    return [{k: v[i:i + half] for k, v in batch.items()} for i in (0, half)]


def run(world: int, rank: int, plan: ParallelPlan, schedule: str, out: dict,
        pretrained: str, checkpoint_dir: str | None = None) -> None:
    from raylm.model.assemble import build_training_model, evaluate
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    def build(**kw):
        return build_training_model(vocab_size=VOCAB, eos_id=0, device=torch.device("cpu"),
                                    precision="fp32", seed=0, plan=plan,
                                    pipeline_schedule=schedule, **kw)

    def step(b, opt, batch, clip):
        return [float(x) for x in train_step(b, opt, halves(batch), accumulation=2,
                                             grad_clip=clip)]

    built = build(preset="tiny", path=None)
    out["params"] = sorted(n for n, _ in built.model.named_parameters())
    # One SGD step at lr 1 with no clipping: the change of each parameter is its gradient.
    sgd = torch.optim.SGD(built.model.parameters(), lr=1.0)
    before = {n: whole(p) for n, p in built.model.named_parameters()}
    out["first"] = step(built, sgd, data(0), 0.0)
    out["grads"] = {n: before[n] - whole(p) for n, p in built.model.named_parameters()}
    opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    out["losses"] = [step(built, opt, data(s), 1.0)[0] for s in range(STEPS)]
    out["masked"] = step(built, opt, masked_data(), 1.0)
    out["val"] = [evaluate(built, halves(data(9))), evaluate(built, halves(masked_data()))]
    if checkpoint_dir:
        checkpoint.save(checkpoint_dir, model=built.model, optimizer=opt,
                        state={"step": STEPS + 1}, config=built.config)
    out["trained"] = {n: whole(p) for n, p in built.model.named_parameters()}

    adapted = build(preset=None, path=pretrained, lora=LORA)
    out["trainable"] = sorted(n for n, p in adapted.model.named_parameters() if p.requires_grad)
    opt = build_optimizer(adapted.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                          device_type="cpu")
    out["lora_losses"] = [step(adapted, opt, masked_data(), 1.0)[0] for _ in range(STEPS)]


def gather(out: dict) -> dict:
    """Every stage's figures in one dict: the stages' parameters side by side, the rest as
    rank 0 has it (the losses are shared with every stage)."""
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, out)
    merged = dict(parts[0])
    for key in ("params", "trainable"):
        merged[key] = sorted(n for p in parts for n in p[key])
    for key in ("grads", "trained"):
        merged[key] = {n: t for p in parts for n, t in p[key].items()}
    merged["stage_params"] = [p["params"] for p in parts]
    return merged


def run_pp2(world: int, rank: int, out: dict, pretrained: str) -> None:
    for schedule in SCHEDULES:
        mine: dict = {}
        run(world, rank, ParallelPlan(pipeline=2), schedule, mine, pretrained,
            checkpoint_dir=f"{pretrained}-pp2-{schedule}")
        out[schedule] = gather(mine)
    # The stages' checkpoint on a tensor-parallel layout of the same two processes.
    out["tp2_reload"] = reload(world, rank, ParallelPlan(tensor=2), f"{pretrained}-pp2-1f1b")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    path, pretrained = str(root / "rank0.pt"), str(root / "pretrained")
    save_pretrained(pretrained)
    run_ranks(worker, args=(2, free_port(), path, pretrained, run_pp2), world=2)
    reference: dict = {}
    torch.set_num_threads(1)
    run(1, 0, DATA_PARALLEL, "1f1b", reference, pretrained)
    return torch.load(path), reference, pretrained


def test_stages_split_layers_by_count_and_say_how():
    assert stage_layers(18, 4) == [range(0, 5), range(5, 10), range(10, 14), range(14, 18)]
    assert describe_split(18, 4) == "layers 0-4 | 5-9 | 10-13 | 14-17"
    assert describe_split(2, 2) == "layers 0 | 1"
    with pytest.raises(ValueError, match="at least one decoder layer per stage"):
        stage_layers(2, 4)
    # Stages vary slowest over the mesh: ranks 0,1 are stage 0, data-parallel ranks 0 and 1.
    plan = ParallelPlan(pipeline=2)
    assert [(x.pp_rank, x.dp_rank) for x in (layout_of(r, 4, plan) for r in range(4))] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_hold_their_layers_under_the_whole_models_names(results, schedule):
    pp, ref, _ = results
    first, last = pp[schedule]["stage_params"]
    assert not set(first) & set(last)
    assert sorted(first + last) == ref["params"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    assert all(".layers.0." in n for n in first if ".layers." in n)
    assert all(".layers.1." in n for n in last if ".layers." in n)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_steps_and_evaluation_match_single_process(results, schedule):
    pp, ref, _ = results
    got = pp[schedule]
    assert got["first"] == pytest.approx(ref["first"], abs=1e-5)  # loss, gradient norm
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-5, msg=name)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert got["masked"] == pytest.approx(ref["masked"], abs=1e-5)
    assert got["val"] == pytest.approx(ref["val"], abs=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lora_under_pipeline_parallelism_matches(results, schedule):
    pp, ref, _ = results
    got = pp[schedule]
    assert got["trainable"] == ref["trainable"] and got["trainable"]
    assert all(".lora_" in n for n in got["trainable"])
    assert got["lora_losses"] == pytest.approx(ref["lora_losses"], abs=1e-5)
    assert got["lora_losses"][-1] < got["lora_losses"][0]


def test_a_checkpoint_saved_by_two_stages_loads_into_the_whole_model(results):
    from raylm.model.assemble import build_training_model
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer

    pp, _, pretrained = results
    model = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=5)
    opt = build_optimizer(model.model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    state = checkpoint.load(f"{pretrained}-pp2-1f1b", model=model.model, optimizer=opt,
                            config=model.config)
    assert state["step"] == STEPS + 1
    for name, p in model.model.named_parameters():
        torch.testing.assert_close(p.detach(), pp["1f1b"]["trained"][name], msg=name)
    assert all(opt.state[p]["step"] == STEPS + 1 for p in model.model.parameters())
    # And into (tp 2) on the two processes that wrote it.
    assert pp["tp2_reload"].keys() == pp["1f1b"]["trained"].keys()
    for name, p in pp["tp2_reload"].items():
        torch.testing.assert_close(p, pp["1f1b"]["trained"][name], msg=name)
