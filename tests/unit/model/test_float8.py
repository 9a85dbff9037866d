"""Float8 training of the decoder blocks' linear layers (torchao), run on the CPU through
torch's reference float8 matmul: which layers convert, what stays as it was (the head, the
state dict, the initial weights), and that the quantized step trains close to fp32."""

from __future__ import annotations

import pytest
import torch

from raylm.model.assemble import build_training_model
from raylm.model.build import build_meta_model, decoder_layers
from raylm.model.float8 import convertible, to_float8
from raylm.model.head_loss import LossHead
from raylm.model.parallelize import ParallelPlan
from raylm.workers.optim import build_optimizer
from raylm.workers.step import train_step

pytest.importorskip("torchao")

VOCAB, CPU = 256, torch.device("cpu")


def build(float8: str):
    return build_training_model(preset="tiny", path=None, vocab_size=VOCAB, eos_id=0,
                                device=CPU, precision="fp32", seed=0,
                                plan=ParallelPlan(float8=float8))


def losses(built, steps: int = 4) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(1, VOCAB, (2, 65), generator=gen)}
    opt = build_optimizer(built.model, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95),
                          device_type="cpu")
    return [float(train_step(built, opt, [batch], accumulation=1, grad_clip=1.0)[0])
            for _ in range(steps)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_block_linears_train_in_float8_and_the_rest_is_unchanged(recipe):
    from torchao.float8.float8_linear import Float8Linear

    plain, f8 = build("off"), build(recipe)
    converted = {n for n, m in f8.model.named_modules() if isinstance(m, Float8Linear)}
    # Every projection of every block; the output head stays in bf16 (a linear layer that
    # computes the loss in chunks: raylm.model.head_loss).
    assert converted and all(".layers." in n for n in converted)
    assert len(converted) == 7 * len(decoder_layers(f8.model))
    assert type(f8.model.get_output_embeddings()) is LossHead
    # Parameters, names and initial values are the unconverted model's: checkpoints and
    # exports do not know float8 was used.
    a, b = plain.model.state_dict(), f8.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref, got = losses(plain), losses(f8)
    assert got[-1] < got[0] - 0.5, got  # memorizing one batch
    # Quantization noise, not a different computation: within 1% of fp32, but not equal (the
    # matmuls did run in float8).
    assert all(abs(g - r) / r < 0.01 for g, r in zip(got, ref, strict=True)), (got, ref)
    assert got != ref


def test_only_plain_linear_layers_with_dimensions_of_16_convert():
    from transformers import GPT2Config, LlamaConfig

    llama = build_meta_model(LlamaConfig(hidden_size=40, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=4, vocab_size=VOCAB))
    blocks = llama.model.layers
    # 40 is not a multiple of 16: only the layers with both sides 16-aligned qualify (none
    # here, as every projection reads or writes the hidden size).
    assert convertible(llama, blocks) == []
    with pytest.raises(ValueError, match="multiples of 16"):
        to_float8(llama, "tensorwise", blocks=blocks, device_type="cpu")
    # GPT-2's projections are Conv1D modules, not nn.Linear: nothing to convert, said so.
    gpt2 = build_meta_model(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=VOCAB))
    assert convertible(gpt2, gpt2.transformer.h) == []
    with pytest.raises(ValueError, match="model.float8=off"):
        to_float8(gpt2, "rowwise", blocks=gpt2.transformer.h, device_type="cpu")
    with pytest.raises(ValueError, match="choose off, tensorwise or rowwise"):
        to_float8(llama, "columnwise", blocks=blocks, device_type="cpu")


def test_tensor_parallelism_is_refused_before_any_mesh():
    from raylm.model.parallelize import parallelize

    model = build_meta_model(build("off").model.config)
    with pytest.raises(ValueError, match="tensor parallelism"):
        parallelize(model, device_type="cpu", precision="fp32",
                    plan=ParallelPlan(float8="tensorwise", tensor=2))
