"""The per-step core without Ray: accumulation arithmetic and loss reporting."""

from __future__ import annotations

import pytest
import torch

from raylm import rundir
from raylm.model.assemble import build_training_model, evaluate
from raylm.model.parallelize import ParallelPlan
from raylm.workers.step import TrainState, train_step
from tests.conftest import floats, head_matmuls, save_tiny_llama

VOCAB = 300


def built():
    return build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0)


def batch(n=8, seq=33, seed=0):
    ids = torch.randint(1, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(n, seq)}


def test_gradient_accumulation_2x4_equals_1x8():
    b = batch()
    one, two = built(), built()
    # Plain SGD with lr 1: the parameter change is exactly the gradient.
    sgd1 = torch.optim.SGD(one.model.parameters(), lr=1.0)
    sgd2 = torch.optim.SGD(two.model.parameters(), lr=1.0)
    loss1, norm1 = floats(train_step(one, sgd1, [b], accumulation=1, grad_clip=0.0))
    halves = [{k: v[:4] for k, v in b.items()}, {k: v[4:] for k, v in b.items()}]
    loss2, norm2 = floats(train_step(two, sgd2, halves, accumulation=2, grad_clip=0.0))
    assert loss1 == pytest.approx(loss2, abs=1e-5)
    assert norm1 == pytest.approx(norm2, abs=1e-5)
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters(),
                              strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-5, rtol=1e-5, msg=name)


def test_wrong_number_of_micro_batches_is_caught():
    b = built()
    with pytest.raises(RuntimeError, match="expected 2 micro-batches, got 1"):
        train_step(b, torch.optim.SGD(b.model.parameters(), lr=0.1), [batch(2)],
                   accumulation=2, grad_clip=1.0)


def test_clipping_bounds_the_update_and_eval_is_a_mean():
    b = built()
    before = [p.detach().clone() for p in b.model.parameters()]
    _, norm = floats(train_step(b, torch.optim.SGD(b.model.parameters(), lr=1.0), [batch()],
                         accumulation=1, grad_clip=0.5))
    delta = torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(b.model.parameters(), before,
                                                                 strict=True)))
    assert norm > 0.5 and float(delta) == pytest.approx(0.5, rel=1e-4)
    losses = [evaluate(b, [batch(seed=s)]) for s in (1, 2)]
    assert evaluate(b, [batch(seed=1), batch(seed=2)]) == pytest.approx(sum(losses) / 2)
    assert b.model.training


def test_train_state_round_trip():
    s = TrainState(step=7, tokens_seen=1234, data_position=56)
    t = TrainState()
    t.load_state_dict(s.state_dict())
    assert t == s


def test_precisions_are_honored_when_asked():
    from raylm.model.assemble import batch_loss
    from raylm.model.parallelize import resolve_precision

    assert resolve_precision("auto", "cpu") == "fp32"  # no native bf16 here: 33x slower
    true = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="bf16-true", seed=0)
    assert {p.dtype for p in true.model.parameters()} == {torch.bfloat16}
    mixed = build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="bf16-mixed", seed=0)
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}  # fp32 masters
    # The head's projection (a matmul whose output is vocabulary-wide, in the chunks of the
    # head loss) runs in bf16; the loss is fp32.
    heads = head_matmuls(mixed.model.lm_head.out_features)  # the vocabulary, padded
    with heads:
        loss = batch_loss(mixed, batch(2), cross_document=True)
    assert heads.seen and {d for _, d in heads.seen} == {torch.bfloat16}
    assert loss.dtype == torch.float32
    fp32 = built()
    assert abs(float(loss) - float(batch_loss(fp32, batch(2), cross_document=True))) < 0.05


def test_activation_checkpointing_and_compile_keep_the_math():
    # ~40 s on 2 CPU cores, almost all of it inductor compiling the two blocks.
    plain, wrapped = built(), build_training_model(
        preset="tiny", path=None, vocab_size=VOCAB, eos_id=0, device=torch.device("cpu"),
        precision="fp32", seed=0,
        plan=ParallelPlan(activation_checkpointing=True, compile=True))
    results = []
    for b in (plain, wrapped):
        sgd = torch.optim.SGD(b.model.parameters(), lr=1.0)
        results.append(floats(train_step(b, sgd, [batch(4)], accumulation=1, grad_clip=0.0)))
    assert results[0] == pytest.approx(results[1], abs=1e-5)
    # Wrapping changes module paths, not the checkpoint's parameter names.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert get_model_state_dict(wrapped.model).keys() == get_model_state_dict(
        plain.model).keys()


def test_core_runs_without_ray_and_mlflow(tmp_path):
    """Build, step, save and load with ray and mlflow unimportable (the GPU bench machines
    have neither)."""
    import subprocess
    import sys

    script = f"""
import sys
sys.modules["ray"] = None
sys.modules["mlflow"] = None
import torch
from raylm.workers import checkpoint
from raylm.workers.optim import build_optimizer
from raylm.model.assemble import build_training_model
from raylm.workers.step import train_step
b = build_training_model(preset="tiny", path=None, vocab_size=300, eos_id=0,
                         device=torch.device("cpu"), precision="fp32")
opt = build_optimizer(b.model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu")
batch = {{"input_ids": torch.randint(1, 300, (2, 17)),
          "position_ids": torch.arange(17).expand(2, 17)}}
train_step(b, opt, [batch], accumulation=1, grad_clip=1.0)
checkpoint.save({str(tmp_path / 'ck')!r}, model=b.model, optimizer=opt,
                state={{"step": 1, "tokens_seen": 32, "data_position": 2}}, config=b.config)
state = checkpoint.load({str(tmp_path / 'ck')!r}, model=b.model, optimizer=opt,
                        config=b.config)
assert state["step"] == 1 and "ray" not in [m.split(".")[0] for m in sys.modules
                                             if sys.modules[m] is not None]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def masked(b, seed=0):
    """``b`` with a loss mask that trains about a third of its targets, unevenly per row."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b["input_ids"].shape, generator=g) < torch.linspace(0.05, 0.6, len(
        b["input_ids"]))[:, None]).to(torch.uint8)
    return {**b, "loss_mask": mask}


def test_masked_loss_is_the_mean_over_the_global_batchs_trained_targets():
    import torch.nn.functional as F

    b = masked(batch())
    # Rows train very different numbers of targets: 1x8 and 4x2 must give the same update.
    per_row = b["loss_mask"][:, 1:].sum(1)
    assert per_row.min() * 3 < per_row.max()
    one, four = built(), built()
    loss1, norm1 = floats(train_step(one, torch.optim.SGD(one.model.parameters(), lr=1.0), [b],
                              accumulation=1, grad_clip=0.0))
    quarters = [{k: v[i:i + 2] for k, v in b.items()} for i in range(0, 8, 2)]
    loss4, norm4 = floats(train_step(four, torch.optim.SGD(four.model.parameters(), lr=1.0),
                              quarters, accumulation=4, grad_clip=0.0))
    assert loss1 == pytest.approx(loss4, abs=1e-6) and norm1 == pytest.approx(norm4, abs=1e-6)
    for p1, p4 in zip(one.model.parameters(), four.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p4, atol=1e-6, rtol=1e-5)
    # The reported loss is the cross-entropy over exactly the trained targets.
    ref = built()
    with torch.no_grad():
        logits = ref.model(input_ids=b["input_ids"][:, :-1]).logits
    trained = b["loss_mask"][:, 1:].bool()
    want = F.cross_entropy(logits[trained], b["input_ids"][:, 1:][trained])
    assert loss1 == pytest.approx(float(want), abs=1e-5)
    assert evaluate(ref, quarters) == pytest.approx(float(want), abs=1e-5)
    # A mask that trains everything is the plain mean.
    full = {**batch(), "loss_mask": torch.ones(8, 33, dtype=torch.uint8)}
    assert evaluate(ref, [full]) == pytest.approx(evaluate(ref, [batch()]), abs=1e-6)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved with save_pretrained, as a pretrained model directory is."""
    return save_tiny_llama(tmp_path_factory.mktemp("pretrained"), vocab_size=VOCAB, seed=3)


def lora_model(path, rank=4):
    return build_training_model(preset=None, path=str(path), vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0,
                                lora={"rank": rank, "alpha": 8.0, "dropout": 0.0,
                                      "target_modules": ["q_proj", "v_proj", "down_proj"]})


def test_lora_starts_as_the_base_model_and_trains_only_the_adapters(pretrained):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(pretrained))
    b = lora_model(pretrained)
    trainable = {n for n, p in b.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 3 targets x (A + B)
    assert len(trainable) == 12
    ids = batch(2)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(b.model(input_ids=ids).logits, base(input_ids=ids).logits)
    frozen = {n: p.detach().clone() for n, p in b.model.named_parameters()
              if not p.requires_grad}
    from raylm.workers.optim import build_optimizer

    opt = build_optimizer(b.model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95),
                          device_type="cpu")
    assert sum(len(g["params"]) for g in opt.param_groups) == 12
    losses = [float(train_step(b, opt, [batch()], accumulation=1, grad_clip=1.0)[0])
              for _ in range(3)]
    assert losses[-1] < losses[0]
    for n, p in b.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n


def test_lora_checkpoints_hold_only_adapters_and_resume_exactly(pretrained, tmp_path):
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer

    def optimizer(b):
        return build_optimizer(b.model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95),
                               device_type="cpu")

    adapters = {"rank": 4, "alpha": 8.0, "target_modules": ["down_proj", "q_proj", "v_proj"]}
    full = lora_model(pretrained)
    opt = optimizer(full)
    losses = [float(train_step(full, opt, [batch(seed=s)], accumulation=1, grad_clip=1.0)[0])
              for s in range(4)]
    first = lora_model(pretrained)
    opt1 = optimizer(first)
    for s in range(2):
        train_step(first, opt1, [batch(seed=s)], accumulation=1, grad_clip=1.0)
    checkpoint.save(tmp_path / "ckpt", model=first.model, optimizer=opt1,
                    state={"step": 2}, config=first.config, adapters=adapters)
    assert rundir.verify(tmp_path / "ckpt").adapters == adapters
    # Adapters and their Adam moments only: the base is read from model.path on every start.
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 12 and all(".lora_" in k for k in model_keys)
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))
    again = lora_model(pretrained)
    opt2 = optimizer(again)
    checkpoint.load(tmp_path / "ckpt", model=again.model, optimizer=opt2, config=again.config,
                    adapters=adapters)
    resumed = [float(train_step(again, opt2, [batch(seed=s)], accumulation=1, grad_clip=1.0)[0])
               for s in (2, 3)]
    assert resumed == pytest.approx(losses[2:], abs=1e-6)
    with pytest.raises(rundir.CheckpointError, match="holds LoRA adapters"):
        checkpoint.load(tmp_path / "ckpt", model=again.model, optimizer=None,
                        config=again.config, adapters={"rank": 8})


@pytest.mark.gpu
def test_qlora_holds_the_base_in_nf4_and_trains_like_lora_in_bf16(tmp_path):
    """On a CUDA device, bf16-mixed: an NF4 base takes under a third of the bf16 base's
    memory, starts within quantization error of it, and its adapters train."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raylm.workers.optim import build_optimizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=64)
    ).save_pretrained(str(tmp_path / "base"))
    lora = {"rank": 16, "alpha": 32, "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"]}
    cuda = torch.device("cuda")
    ids = batch(8)["input_ids"].to(cuda)
    memory, losses = {}, {}
    for base in ("none", "nf4"):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        built = build_training_model(preset=None, path=str(tmp_path / "base"),
                                     vocab_size=VOCAB, eos_id=0, device=cuda,
                                     precision="bf16-mixed", lora=lora,
                                     base_quantization=base)
        memory[base] = torch.cuda.memory_allocated() - before
        opt = build_optimizer(built.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cuda")
        losses[base] = [float(train_step(built, opt, [{"input_ids": ids}], accumulation=1,
                                   grad_clip=1.0)[0]) for _ in range(5)]
        del built, opt
    assert memory["nf4"] < memory["none"] / 3, memory
    assert losses["nf4"][0] == pytest.approx(losses["none"][0], abs=0.05)
    assert losses["nf4"][-1] < losses["nf4"][0]


def test_an_nf4_base_holds_four_bit_weights_and_keeps_no_dense_copy_for_backward(tmp_path):
    """QLoRA on the CPU in bf16-mixed, blocks compiled as on a GPU: after setup each adapted
    layer's frozen weight is stored in NF4 (about a quarter of its bf16 bytes), and what the
    step saves for backward holds no dense copy of any of them (compile once kept every
    dequantized weight: a bf16 copy of the whole base, as much as LoRA on a bf16 base). The
    step computes what torchao's own NF4 linear computes."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raylm.model.lora import NF4Linear
    from raylm.model.parallelize import autocast

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    ).save_pretrained(str(tmp_path / "base"))
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "auto"}
    ids = batch(2)["input_ids"]

    def setup(compile_):
        return build_training_model(preset=None, path=str(tmp_path / "base"), vocab_size=VOCAB,
                                    eos_id=0, device=torch.device("cpu"),
                                    precision="bf16-mixed", lora=lora, base_quantization="nf4",
                                    plan=ParallelPlan(compile=compile_))

    compiled = setup(True)
    bases = [m.weight for m in compiled.model.modules() if isinstance(m, NF4Linear)]
    assert len(bases) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    stored = sum(t.untyped_storage().nbytes() for w in bases
                 for t in (getattr(w, k) for k in w.__tensor_flatten__()[0]))
    dense = sum(w.numel() * 2 for w in bases)
    assert stored < 0.3 * dense, (stored, dense)
    shapes = {tuple(w.shape) for w in bases} | {tuple(w.shape[::-1]) for w in bases}
    kept = []

    def pack(t):
        if not is_traceable_wrapper_subclass(t) and tuple(t.shape) in shapes:
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast("bf16-mixed", "cpu"):
            logits = compiled.model(input_ids=ids[:, :-1]).logits
    logits.float().mean().backward()
    assert kept == [], kept
    eager = setup(False)
    for m in eager.model.modules():
        if isinstance(m, NF4Linear):
            m.__class__ = torch.nn.Linear  # torchao's NF4 linear
    ours = setup(False)
    losses = []
    for b in (eager, ours, compiled):
        opt = torch.optim.AdamW([p for p in b.model.parameters() if p.requires_grad], lr=1e-2)
        losses.append([float(train_step(b, opt, [{"input_ids": ids}], accumulation=1,
                                        grad_clip=1.0)[0]) for _ in range(2)])
    assert losses[1] == losses[0]
    # Compiled bf16 kernels round differently; one lr 1e-2 update then amplifies that.
    assert losses[2][0] == pytest.approx(losses[0][0], rel=1e-3)
    assert losses[2][1] == pytest.approx(losses[0][1], rel=1e-2)
