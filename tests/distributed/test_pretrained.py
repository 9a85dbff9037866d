"""Pretrained models as users bring them: what raylm builds, materializes, loads and shards
computes what ``transformers`` computes, with tied and untied embeddings, full and LoRA, on one
process and on 2 gloo ranks (FSDP2), before training and after a checkpoint's resume.

The models are tiny random-weight ones built here from ``transformers``' config classes and
saved with ``save_pretrained`` (nothing is downloaded); a tied model's file stores the shared
weight once, as published tied models do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from raylm.model.lora import settings as lora_settings
from tests.distributed.shared import exit_now
from tests.ranks import free_port, run_ranks

VOCAB = 384
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def family_config(family: str, *, tied: bool | None = None):
    """A tiny config of ``family`` from transformers' own config class (``tied`` None: the
    family's default)."""
    import transformers as T

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if tied is not None:
        shape["tie_word_embeddings"] = tied
    heads16 = dict(head_dim=16)
    return {
        "llama": lambda: T.LlamaConfig(**shape),
        "qwen2": lambda: T.Qwen2Config(**shape),
        "mistral": lambda: T.MistralConfig(**shape),
        "olmo2": lambda: T.Olmo2Config(**shape),
        # Fused qkv_proj and gate_up_proj.
        "phi3": lambda: T.Phi3Config(**shape, pad_token_id=0),
        # No SDPA path in transformers 5 (soft-capped attention logits): eager on CPU.
        "gemma2": lambda: T.Gemma2Config(**shape, **heads16),
        # Embeddings scaled by a buffer no checkpoint holds; rotary frequencies per layer type.
        "gemma3": lambda: T.Gemma3TextConfig(**shape, **heads16),
        # Per-head query and key norms.
        "qwen3": lambda: T.Qwen3Config(**shape, **heads16),
        # Scales its embeddings in the model's forward, its residuals, attention and logits.
        "granite": lambda: T.GraniteConfig(**shape, embedding_multiplier=12.0,
                                           residual_multiplier=0.22, attention_multiplier=0.1,
                                           logits_scaling=4.0),
        # Conv1D projections under transformer.h, attention dropout, tied by default.
        "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=128, **({} if tied is None
                                                         else {"tie_word_embeddings": tied})),
        # Experts stored one by one, fused by transformers on load.
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**shape, **heads16, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32),
    }[family]()


def save_family(out: Path, family: str, *, tied: bool | None = None, **settings) -> Path:
    """A tiny random-weight model of ``family``, saved as a pretrained directory (``settings``:
    config attributes to change)."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, tied=tied)
    for key, value in settings.items():
        setattr(config, key, value)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    # Norm weights start at 1; others at random: a load that skips a tensor shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(out))
    return out


def inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def reference_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=inputs()).logits


def built_logits(built) -> torch.Tensor:
    built.model.eval()
    with torch.no_grad():
        out = built.model(input_ids=inputs()).logits
    built.model.train()
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def build(path: Path, lora: dict | None):
    from raylm.model.assemble import build_training_model

    return build_training_model(preset=None, path=str(path), vocab_size=VOCAB, eos_id=0,
                                device=torch.device("cpu"), precision="fp32", seed=0,
                                lora=lora)


def tied_parameters(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_loaded_model_computes_what_transformers_computes(tmp_path, family, tied, lora):
    path = save_family(tmp_path / family, family, tied=tied)
    built = build(path, lora)
    got, want = built_logits(built), reference_logits(path)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # A tied model keeps one tensor: an untied copy would train apart from the embeddings.
    names = [n.split(".")[-2] for n in tied_parameters(built.model)]
    assert names == (["embed_tokens"] if tied else ["embed_tokens", "lm_head"])


@pytest.mark.parametrize("family", ["mistral", "olmo2", "phi3", "gemma2", "gpt2"])
def test_each_family_loads_as_transformers_does_and_trains_full_and_with_lora(tmp_path, family):
    from raylm.model.lora import linear_projections
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    path = save_family(tmp_path / family, family)
    want = reference_logits(path)
    for adapters in (None, {**LORA, "target_modules": "auto"}):
        built = build(path, adapters)
        got = built_logits(built)
        assert torch.allclose(got, want, atol=1e-5), (family, (got - want).abs().max())
        opt = build_optimizer(built.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cpu")
        loss, norm = train_step(built, opt, [{"input_ids": inputs()}], accumulation=1,
                                grad_clip=1.0)
        assert torch.isfinite(loss) and float(norm) > 0
    # LoRA's auto targets are every projection of the blocks, under the family's own names.
    assert linear_projections(built.model) == {
        "mistral": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                    "v_proj"],
        "olmo2": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
        "gemma2": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                   "v_proj"],
        "gpt2": ["c_attn", "c_fc", "c_proj"],
    }[family]
    assert built.attention.backend == {"gemma2": "eager", "gpt2": "sdpa-math-cpu"}.get(
        family, "sdpa-flash-cpu")
    # A slower kernel says why (a worker prints it once; the summary records the kernel).
    assert built.attention.fallback.startswith({"gemma2": "Gemma2ForCausalLM does not implement "
                                                          "sdpa",
                                                "gpt2": "GPT2LMHeadModel drops out attention"
                                                }.get(family, "")), built.attention.fallback
    assert bool(built.attention.fallback) == (family in ("gemma2", "gpt2"))


def test_mixture_of_experts_files_load_as_transformers_converts_them(tmp_path):
    """Qwen3-MoE's files hold each expert's projections apart and the model holds them fused:
    the weights are read through transformers' own conversion, and the model computes its
    logits, fully fine-tuned and with LoRA (on attention: the experts are fused parameters,
    not linear layers, and the router beside them is no target)."""
    from raylm.model.lora import linear_projections
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    path = save_family(tmp_path / "moe", "qwen3_moe")
    want = reference_logits(path)
    for lora in (None, {**LORA, "target_modules": "auto"}):
        built = build(path, lora)
        got = built_logits(built)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        opt = build_optimizer(built.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cpu")
        loss, norm = train_step(built, opt, [{"input_ids": inputs()}], accumulation=1,
                                grad_clip=1.0)
        assert torch.isfinite(loss) and float(norm) > 0
    assert linear_projections(built.model) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_mixture_of_experts_on_two_ranks_loads_trains_and_resumes(tmp_path):
    """Read on rank 0 through transformers' conversion, broadcast into FSDP2's shards of the
    fused experts; a checkpoint of the two ranks resumes exactly."""
    path = save_family(tmp_path / "moe", "qwen3_moe")
    out = str(tmp_path / "result.pt")
    run_ranks(ranks_worker, args=(2, free_port(), str(path), out, True), world=2)
    r = torch.load(out)
    want = reference_logits(path)
    assert torch.allclose(r["loaded"], want, atol=1e-5), (r["loaded"] - want).abs().max()
    assert not torch.allclose(r["trained"], r["loaded"], atol=1e-4)
    assert torch.allclose(r["resumed"], r["trained"], atol=1e-5)


def test_weights_that_are_not_the_models_are_refused_naming_them(tmp_path):
    """An incomplete download, or another model's files: refused before any is read."""
    from safetensors.torch import load_file, save_file

    from raylm.model.build import WeightsError, build_config, build_meta_model
    from raylm.model.weights import check_weights

    path = save_family(tmp_path / "qwen2", "qwen2")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = build_config(preset=None, path=str(path), vocab_size=VOCAB, eos_id=0,
                          attn_implementation="eager")
    with pytest.raises(WeightsError, match=r"lacks 1 weights .*layers\.1\.mlp\.up_proj.* "
                                           r"and holds 1 .*mlp\.extra.*not this model's"):
        check_weights(build_meta_model(config), path)
    with pytest.raises(WeightsError, match="lacks"):
        build(path, None)


def ranks_worker(rank: int, world: int, port: int, path: str, out: str, lora: bool) -> None:
    """On 2 ranks: logits of the loaded, sharded model; one step; a checkpoint; the logits of
    a fresh model resumed from it against the trained one's."""
    import torch.distributed as dist

    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        adapters = LORA if lora else None
        built = build(Path(path), adapters)
        # Before any forward, as a worker does: FSDP2 leaves the root's parameters gathered
        # after a forward that no backward follows, and an optimizer built then would hold
        # those instead of the shards.
        opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cpu")
        loaded = built_logits(built)
        batch = {"input_ids": inputs()[rank:rank + 1]}
        loss = float(train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)[0])
        trained = built_logits(built)
        ckpt = f"{out}.ckpt"
        checkpoint.save(ckpt, model=built.model, optimizer=opt, config=built.config,
                        state={"step": 1, "tokens_seen": 0, "data_position": 2})
        fresh = build(Path(path), adapters)
        checkpoint.load(ckpt, model=fresh.model, optimizer=None, config=fresh.config)
        resumed = built_logits(fresh)
        if rank == 0:
            import torch.distributed.checkpoint as dcp

            stored = list(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
            torch.save({"loaded": loaded, "trained": trained, "resumed": resumed,
                        "loss": loss, "params": tied_parameters(built.model),
                        "stored": [k for k in stored if k.startswith("model.")]}, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_tied_model_on_two_ranks_loads_trains_and_resumes_as_one_tensor(tmp_path, lora):
    path = save_family(tmp_path / "model", "qwen2", tied=True)
    out = str(tmp_path / "result.pt")
    run_ranks(ranks_worker, args=(2, free_port(), str(path), out, lora), world=2)
    r = torch.load(out)
    want = reference_logits(path)
    assert torch.allclose(r["loaded"], want, atol=1e-5), (r["loaded"] - want).abs().max()
    assert not torch.allclose(r["trained"], r["loaded"], atol=1e-4)  # the step changed it
    assert torch.allclose(r["resumed"], r["trained"], atol=1e-5)
    assert [n.split(".")[-2] for n in r["params"]] == ["embed_tokens"]
    # A LoRA checkpoint holds the adapters alone: not the frozen head under its tied name.
    heads = [k for k in r["stored"] if "lm_head" in k or "embed_tokens" in k]
    assert heads == ([] if lora else ["model.model.embed_tokens.weight"]), heads
    assert not lora or all(".lora_" in k for k in r["stored"]), r["stored"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_model_stored_in_bf16_trains_in_the_runs_dtypes(tmp_path, precision):
    """Published checkpoints are stored in bf16; the run's precision decides what trains: fp32
    masters for what trains, and a frozen LoRA base in bf16 only under bf16-mixed."""
    from transformers import AutoModelForCausalLM

    from raylm.model.assemble import build_training_model

    path = save_family(tmp_path / "model", "qwen2", tied=True)
    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).save_pretrained(
        str(tmp_path / "bf16"))
    frozen = torch.float32 if precision == "fp32" else torch.bfloat16
    for lora in (None, LORA):
        built = build_training_model(preset=None, path=str(tmp_path / "bf16"), vocab_size=VOCAB,
                                     eos_id=0, device=torch.device("cpu"), precision=precision,
                                     lora=lora)
        dtypes = {n: p.dtype for n, p in built.model.named_parameters()}
        assert {d for n, d in dtypes.items() if ".lora_" in n or not lora} == {torch.float32}
        assert not lora or {d for n, d in dtypes.items() if ".lora_" not in n} == {frozen}
        # Still one tied tensor, holding the stored values.
        assert len(tied_parameters(built.model)) == 1
        want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).get_input_embeddings()
        assert torch.equal(built.model.get_input_embeddings().weight.float(),
                           want.weight.float())


def test_an_nf4_base_is_checked_on_the_adapted_layers():
    """The QLoRA shape check looks at the frozen weights inside the LoRA layers (125m: 768 x
    768 splits into whole NF4 blocks on 2 ranks, not on 5)."""
    from raylm.model.build import build_config, build_meta_model
    from raylm.model.lora import add_adapters, check_nf4_shapes

    config = build_config(preset="125m", path=None, vocab_size=VOCAB, eos_id=0,
                          attn_implementation="eager")
    model = add_adapters(build_meta_model(config), **{**LORA, "target_modules": "auto"})
    check_nf4_shapes(model, "auto", 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight "
                                         r"\(768x768\) does not split into 5 shards"):
        check_nf4_shapes(model, "auto", 5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "olmo2", "phi3", "gemma2",
                                    "gemma3", "gpt2", "granite"])
def test_each_family_trains_exports_and_generates_in_a_transformers_pipeline(tmp_path, family):
    """A step of full fine-tuning and one with LoRA, each checkpointed into a run directory as
    a worker does; `raylm export` (the LoRA run merged, and as peft's adapter) gives what a
    plain transformers pipeline loads and generates with, computing the trained model's
    logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, pipeline

    from raylm.config import load_config
    from raylm.data.tokenizer import save_hf_tokenizer, train_bpe
    from raylm.formats.exporter import export, write_run_info
    from raylm.workers import checkpoint
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step
    from tests.conftest import make_docs

    base = save_family(tmp_path / "base", family)
    tokenizer = tmp_path / "tokenizer"
    bpe = train_bpe(iter(make_docs(60)), vocab_size=VOCAB - 84)
    save_hf_tokenizer(bpe, tokenizer)
    for name, rank in (("full", 0), ("lora", 4)):
        cfg = load_config(None, [f"--model.path={base}", f"--tokenizer.path={tokenizer}",
                                 f"--lora.rank={rank}", "--lora.alpha=8", "--lora.dropout=0",
                                 "--scaling.use_gpu=false"])
        built = build(base, {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                             "target_modules": "auto"} if rank else None)
        opt = build_optimizer(built.model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95),
                              device_type="cpu")
        train_step(built, opt, [{"input_ids": inputs()}], accumulation=1, grad_clip=1.0)
        trained = built_logits(built)
        run = tmp_path / name
        write_run_info(str(run), config=cfg.to_dict(), vocab_size=VOCAB, eos_id=0,
                       tokenizer_path=str(tokenizer), prepared="")
        checkpoint.save(run / "checkpoint_2026-01-01_00-00-00.000001", model=built.model,
                        optimizer=opt, config=built.config, state={"step": 1},
                        adapters=lora_settings(cfg.lora))
        out = export(run, tmp_path / f"{name}-hf", merge=True, log=lambda m: None)
        model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            assert torch.allclose(model(input_ids=inputs()).logits, trained, atol=1e-4), (
                family, name)
        generate = pipeline("text-generation", model=str(out), device="cpu")
        text = generate("Document 3.", max_new_tokens=4, do_sample=False)[0]["generated_text"]
        assert text.startswith("Document 3.")
        if rank:
            adapter = export(run, tmp_path / "adapter", log=lambda m: None)
            peft_model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()
            with torch.no_grad():
                assert torch.allclose(peft_model(input_ids=inputs()).logits, trained,
                                      atol=1e-4), family


# Families each layout is tested with (2 ranks against one process).
LAYOUT_FAMILIES = {
    # Every family, full and LoRA on its auto targets: FSDP2 shards whatever the model holds.
    "fsdp2": ["qwen2", "mistral", "qwen3", "gemma3", "gemma2", "granite", "olmo2", "phi3",
              "gpt2", "qwen3_moe"],
    "tensor": ["qwen2", "mistral", "qwen3", "gemma3", "gemma2", "granite"],
    # Untied: a pipeline of a tied model is refused.
    "pipeline": ["qwen2", "mistral", "qwen3", "gemma3", "gemma2", "granite"],
}
AUTO = {**LORA, "target_modules": "auto"}


def layout_batches(layout: str, rank: int | None) -> list[dict[str, torch.Tensor]]:
    """25 tokens a row, so 24 targets split into whole halves under sequence parallelism. Two
    micro-batches (a row each) for a pipeline of 2 stages; under FSDP2, rank ``rank``'s row
    (None: both, as one process has them)."""
    ids = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(4))
    if layout == "pipeline":
        return [{"input_ids": ids[:1]}, {"input_ids": ids[1:]}]
    if layout == "fsdp2" and rank is not None:
        return [{"input_ids": ids[rank:rank + 1]}]
    return [{"input_ids": ids}]


def two_steps(path: str, *, layout: str, lora: dict | None, rank: int | None
              ) -> list[list[float]]:
    """Loss and gradient norm of two AdamW steps of the model at ``path``, laid out as
    ``layout`` (``rank`` None: one process)."""
    from raylm.model.assemble import build_training_model
    from raylm.model.parallelize import ParallelPlan
    from raylm.workers.optim import build_optimizer
    from raylm.workers.step import train_step

    plan = ParallelPlan(**({"tensor": 2} if layout == "tensor" else
                           {"pipeline": 2} if layout == "pipeline" else {}))
    built = build_training_model(preset=None, path=path, vocab_size=VOCAB, eos_id=0,
                                 device=torch.device("cpu"), precision="fp32", seed=0,
                                 lora=lora, plan=plan if rank is not None else ParallelPlan())
    opt = build_optimizer(built.model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95),
                          device_type="cpu")
    batches = layout_batches(layout, rank)
    return [[float(x) for x in train_step(built, opt, batches, accumulation=len(batches),
                                          grad_clip=1.0)] for _ in range(2)]


def layout_worker(rank: int, world: int, port: int, root: str, out: str, layout: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {(family, name): two_steps(f"{root}/{family}", layout=layout, lora=lora,
                                             rank=rank)
                   for family in LAYOUT_FAMILIES[layout]
                   for name, lora in (("full", None), ("lora", AUTO))}
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


@pytest.mark.parametrize("layout", list(LAYOUT_FAMILIES))
def test_each_family_on_two_ranks_trains_as_one_process(tmp_path, layout):
    """FSDP2 (every family), tensor with sequence parallelism over each family's own plan
    (Gemma's four block norms and Qwen3's and Gemma's per-head norms included), and 2
    pipeline stages (Gemma 2's logit cap on the last stage, Granite's embedding multiplier on
    the first only): two steps' losses and gradient norms equal one process's (fp32, 1e-5),
    full and with LoRA on the auto targets."""
    for family in LAYOUT_FAMILIES[layout]:
        # GPT-2 drops out attention, residuals and embeddings: each rank would draw its own.
        save_family(tmp_path / family, family, tied=False if layout == "pipeline" else None,
                    **({"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
                       if family == "gpt2" else {}))
    out = str(tmp_path / "split.pt")
    run_ranks(layout_worker, args=(2, free_port(), str(tmp_path), out, layout), world=2)
    split = torch.load(out)
    for family in LAYOUT_FAMILIES[layout]:
        for name, lora in (("full", None), ("lora", AUTO)):
            want = two_steps(str(tmp_path / family), layout=layout, lora=lora, rank=None)
            got = split[family, name]
            assert got == [pytest.approx(w, rel=1e-5) for w in want], (family, name, got, want)


def test_layouts_a_family_cannot_take_are_refused_before_any_worker_starts(tmp_path):
    from raylm.model.build import build_config
    from raylm.model.parallelize import check_tensor_parallel
    from raylm.model.pipeline import check_pipeline

    def config(family):
        return build_config(preset=None, path=str(save_family(tmp_path / family, family,
                                                              tied=False)),
                            vocab_size=VOCAB, eos_id=0, attn_implementation="eager")

    for family, what in (("phi3", "'layers.*.self_attn.qkv_proj' as 'colwise_gather_output'"),
                         ("olmo2", "as 'colwise_gather_output'"),
                         ("gpt2", "ship no tensor-parallel plan"),
                         ("qwen3_moe", "as 'packed_colwise'")):
        with pytest.raises(ValueError, match=f"parallel.tensor=2: .*{what}.*parallel.tensor=1"):
            check_tensor_parallel(config(family), tensor=2, seq_len=24)
    with pytest.raises(ValueError, match=r"parallel.pipeline=2: GPT2 models .*model\.layers"):
        check_pipeline(config("gpt2"), pipeline=2)
