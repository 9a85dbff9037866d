"""The CUDA path on a real GPU: bf16 mixed precision, FSDP2's parameter dtypes, the attention
kernel that is recorded, per-document attention, fused AdamW, compile and activation
checkpointing, float8 linears, DPO steps on LoRA adapters and on stored reference figures,
checkpoints moving between GPU and CPU, and the NVML energy counter.

Needs torch and transformers (torchao for the float8 test, peft for the DPO one), not Ray,
MLflow or datasets: ``python -m pytest -m gpu tests/gpu`` on any machine with a CUDA GPU;
skipped elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from raylm.config import DpoConfig
from raylm.model.assemble import build_training_model
from raylm.model.parallelize import ParallelPlan
from raylm.workers import checkpoint
from raylm.workers.optim import build_optimizer
from raylm.workers.step import train_step

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
VOCAB = 512


def build(device=CUDA, **kwargs):
    kwargs.setdefault("precision", "bf16-mixed")
    return build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=device, seed=0, **kwargs)


def batch(n: int = 4, seq: int = 129, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, VOCAB, (n, seq), generator=gen)}


def optimizer(built):
    return build_optimizer(built.model, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95),
                           device_type=built.device.type)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_bf16_mixed_step_trains_with_fp32_weights_and_fused_adamw():
    built = build(precision="auto")
    assert built.precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 and p.is_cuda for p in built.model.parameters())
    opt = optimizer(built)
    assert opt.defaults["fused"] is True
    b = batch()
    losses = [float(train_step(built, opt, [b], accumulation=1, grad_clip=1.0)[0])
              for _ in range(20)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses  # memorizing one batch


def test_fused_adamw_takes_the_step_the_foreach_one_takes():
    models = [build(precision="fp32") for _ in range(2)]
    # fp32 on CUDA: the flash kernels take 16-bit inputs only.
    assert models[0].attention.backend == "sdpa-efficient-cuda"
    b = batch()
    params = []
    for built, fused in zip(models, (True, False), strict=True):
        opt = torch.optim.AdamW(built.model.parameters(), lr=1e-3, fused=fused,
                                foreach=None if fused else True)
        for _ in range(3):
            train_step(built, opt, [b], accumulation=1, grad_clip=0.0)
        params.append(torch.cat([p.detach().flatten() for p in built.model.parameters()]))
    assert relative_error(params[0], params[1]) < 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_keeps_fp32_master_weights_computes_in_bf16_and_reduces_in_fp32():
    """FSDP2 on a one-GPU NCCL group: the sharded parameters and their gradients stay fp32
    (the optimizer updates fp32 masters); the blocks compute in bf16."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from raylm.model.build import build_config, build_meta_model, init_weights
    from raylm.model.parallelize import shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        config = build_config(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                              attn_implementation="sdpa")
        model = shard(build_meta_model(config), mesh=init_device_mesh("cuda", (1,)),
                      precision="bf16-mixed")
        model.to_empty(device=CUDA)
        init_weights(model, seed=0, num_layers=config.num_hidden_layers)
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32
                   for p in model.parameters())
        seen = []
        layer = model.model.layers[0].self_attn.q_proj
        layer.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        tokens = batch()["input_ids"].to(CUDA)
        logits = model(input_ids=tokens[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                          tokens[:, 1:].flatten()).backward()
        assert seen == [(torch.bfloat16, torch.bfloat16)]
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in model.parameters())
    finally:
        dist.destroy_process_group()


def _ops(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


def test_the_recorded_attention_kernel_is_the_one_that_runs():
    full = build()
    assert full.attention.backend == "sdpa-flash-cuda"
    b = batch()
    ops = _ops(lambda: train_step(full, optimizer(full), [b], accumulation=1, grad_clip=1.0))
    assert "aten::_scaled_dot_product_flash_attention" in ops
    assert not {o for o in ops if "efficient_attention" in o or o == "aten::_softmax"}

    per_doc = build(cross_document=False)
    assert per_doc.attention.backend in ("flex-attention", "flash-attn-varlen")
    pos = torch.cat([torch.arange(60), torch.arange(69)]).expand(4, 129)
    ops = _ops(lambda: train_step(per_doc, optimizer(per_doc),
                                  [{**b, "position_ids": pos}], accumulation=1,
                                  grad_clip=1.0, cross_document=False))
    assert not {o for o in ops if "scaled_dot_product" in o}, "an SDPA kernel ran"
    if per_doc.attention.backend == "flex-attention":
        assert any("flex_attention" in o for o in ops), sorted(ops)


@pytest.mark.parametrize("requested", ["auto", "sdpa"])
def test_per_document_attention_matches_each_document_alone(requested):
    packed = build(cross_document=False, attention=requested)
    alone = build()  # the same weights (initialization is seeded by name)
    lengths = [50, 30, 49]
    ids = batch(n=1, seq=sum(lengths))["input_ids"].to(CUDA)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(CUDA)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with packed.attention.context():
            together = packed.model(input_ids=ids, position_ids=pos).logits
        start = 0
        for n in lengths:
            with alone.attention.context():
                own = alone.model(input_ids=ids[:, start:start + n]).logits
            assert relative_error(together[:, start:start + n], own) < 1e-2, (requested, n)
            start += n


def test_compile_and_activation_checkpointing_leave_the_loss_unchanged():
    batches = [batch(seed=s) for s in range(4)]
    curves = {}
    for name, plan in {"plain": ParallelPlan(),
                       "checkpointed": ParallelPlan(activation_checkpointing=True),
                       "compiled": ParallelPlan(compile=True),
                       "both": ParallelPlan(activation_checkpointing=True, compile=True)
                       }.items():
        built = build(plan=plan)
        opt = optimizer(built)
        curves[name] = [float(train_step(built, opt, [b], accumulation=1, grad_clip=1.0)[0])
                        for b in batches]
    for name, curve in curves.items():
        assert curve == pytest.approx(curves["plain"], rel=1e-2), (name, curves)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_compile_and_train_close_to_bf16(recipe):
    pytest.importorskip("torchao")
    batches = [batch(seed=s) for s in range(4)]
    curves = {}
    for name in ("off", recipe):
        built = build(plan=ParallelPlan(compile=True, float8=name))
        opt = optimizer(built)
        curves[name] = [float(train_step(built, opt, [b], accumulation=1, grad_clip=1.0)[0])
                        for b in batches]
    assert curves[recipe] == pytest.approx(curves["off"], rel=2e-2), curves


def test_a_dpo_step_on_lora_trains_in_bf16_with_its_base_as_reference():
    from raylm.workers.preference import preference_evaluate, preference_step
    from tests.pairs import pair_blocks

    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    built = build(lora=lora, cross_document=False)
    assert built.attention.backend in ("flex-attention", "flash-attn-varlen")
    trained = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    pairs = pair_blocks(4, seq=128, vocab=VOCAB)
    objective = DpoConfig(loss="sigmoid", beta=0.5)
    # The same bf16 kernels score the policy and its reference: the first loss is ln 2.
    assert preference_evaluate(built, [pairs], objective)["val_loss"] == pytest.approx(
        0.6931472, abs=1e-6)
    for _ in range(10):
        loss, norm, figures = preference_step(built, opt, [pairs], accumulation=1,
                                              objective=objective, grad_clip=1.0)
    assert loss.is_cuda and float(loss) < 0.5 and float(figures["accuracy"]) > 0.9


def test_a_full_dpo_step_on_stored_reference_figures_starts_at_ln2_in_bf16():
    """The reference pass's figures (scored in bf16 on the GPU, stored on the host) summed
    beside the policy's: the first loss is ln 2 within bf16's batch-to-batch noise, and the
    step trains."""
    from raylm.contracts import REFERENCE_COLUMN
    from raylm.workers.preference import (
        preference_evaluate,
        preference_step,
        reference_logps,
    )
    from tests.pairs import pair_blocks

    built = build(cross_document=False)
    pairs = pair_blocks(4, seq=128, vocab=VOCAB)
    built.model.eval()
    # Scored two blocks at a time, as the pass's micro-batches cut them.
    stored = torch.cat([reference_logps(built, {k: v[i:i + 2] for k, v in pairs.items()})
                        for i in (0, 2)])
    built.model.train()
    assert stored.device.type == "cpu" and stored.dtype == torch.float32
    pairs[REFERENCE_COLUMN] = stored
    objective = DpoConfig(loss="sigmoid", beta=0.5)
    assert preference_evaluate(built, [pairs], objective)["val_loss"] == pytest.approx(
        0.6931472, abs=2e-3)
    opt = optimizer(built)
    for _ in range(10):
        loss, _, figures = preference_step(built, opt, [pairs], accumulation=1,
                                           objective=objective, grad_clip=1.0)
    assert loss.is_cuda and float(loss) < 0.6 and float(figures["accuracy"]) > 0.9


def test_a_checkpoint_saved_on_gpu_resumes_on_cpu_and_back(tmp_path):
    gpu = build()
    opt = optimizer(gpu)
    for s in range(2):
        train_step(gpu, opt, [batch(seed=s)], accumulation=1, grad_clip=1.0)
    checkpoint.save(tmp_path / "gpu", model=gpu.model, optimizer=opt,
                    state={"step": 2, "tokens_seen": 1024, "data_position": 8},
                    config=gpu.config)
    cpu = build(device=torch.device("cpu"), precision="fp32")
    cpu_opt = optimizer(cpu)
    state = checkpoint.load(tmp_path / "gpu", model=cpu.model, optimizer=cpu_opt,
                            config=cpu.config)
    assert state["step"] == 2
    for (name, p), q in zip(gpu.model.named_parameters(), cpu.model.parameters(),
                            strict=True):
        assert torch.equal(p.detach().cpu(), q.detach()), name
    assert int(cpu_opt.state_dict()["state"][0]["step"]) == 2
    train_step(cpu, cpu_opt, [batch(seed=2)], accumulation=1, grad_clip=1.0)
    checkpoint.save(tmp_path / "cpu", model=cpu.model, optimizer=cpu_opt,
                    state={"step": 3, "tokens_seen": 1536, "data_position": 12},
                    config=cpu.config)
    back = build()
    back_opt = optimizer(back)
    assert checkpoint.load(tmp_path / "cpu", model=back.model, optimizer=back_opt,
                           config=back.config)["step"] == 3
    for (name, p), q in zip(cpu.model.named_parameters(), back.model.parameters(),
                            strict=True):
        assert torch.equal(p.detach(), q.detach().cpu()), name
    # Both continue alike (bf16 on the GPU, fp32 on the CPU).
    nxt = batch(seed=3)
    on_gpu = float(train_step(back, back_opt, [nxt], accumulation=1, grad_clip=1.0)[0])
    on_cpu = float(train_step(cpu, cpu_opt, [nxt], accumulation=1, grad_clip=1.0)[0])
    assert on_gpu == pytest.approx(on_cpu, rel=1e-2)


def test_the_energy_counter_reads_this_gpu():
    import pynvml

    from raylm.workers.energy import EnergyCounter

    counter = EnergyCounter(CUDA)
    assert counter.available
    # Matched by UUID: NVML's device is the one CUDA calls CUDA:0.
    uuid = str(torch.cuda.get_device_properties(CUDA).uuid)
    assert pynvml.nvmlDeviceGetUUID(counter.handle).endswith(uuid)
    a = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    j0, t0 = counter.read(), time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    j1, t1 = counter.read(), time.perf_counter()
    watts = (j1 - j0) / (t1 - t0)
    print(f"energy counter: {j1 - j0:.1f} J over {t1 - t0:.2f} s = {watts:.0f} W")
    assert 30 < watts < 1500
