"""Float8 training of the decoder blocks' linear layers, through torchao.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``: each
matmul of the forward and backward passes casts its two operands to float8 (e4m3) with dynamic
scales, one per tensor (``tensorwise``) or one per row (``rowwise``, closer to bf16 at a little
more cost), runs on the GPU's float8 tensor cores and returns bf16. The parameters stay
ordinary tensors in the dtypes train.precision gives them, so the state dict, checkpoints,
exports and FSDP2 sharding are those of the unconverted model.

What raylm decides here is which layers convert: the linear layers inside the decoder blocks
whose two dimensions are multiples of 16 (what the float8 matmul needs). The output head stays
in bf16, as it is the matmul most sensitive to rounding and its logits feed the loss
directly; embeddings are not matmuls. Converting happens on the meta model, before blocks
are compiled (the casts fuse into the compiled block) and sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.console import quiet_torchao

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)


def check_device(device_type: str) -> None:
    """Float8 matmuls need CUDA compute capability 8.9+; CPUs run them through torch's
    reference kernel (slow: tests only)."""
    if device_type != "cuda":
        return
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"model.float8 needs a GPU of compute capability 8.9 or later (H100, H200, L4, "
            f"RTX 4090); this one ({torch.cuda.get_device_name()}) is "
            f"{capability[0]}.{capability[1]}: set model.float8=off")


def convertible(module: nn.Module, blocks: nn.Module) -> list[str]:
    """Names (in ``module``) of the plain linear layers inside ``blocks`` with float8-friendly
    dimensions. LoRA-wrapped and quantized layers are not plain ``nn.Linear``; GPT-2's
    ``Conv1D`` is not one either."""
    inside = {id(m) for m in blocks.modules()}
    return [name for name, m in module.named_modules()
            if type(m) is nn.Linear and id(m) in inside
            and m.in_features % 16 == 0 and m.out_features % 16 == 0]


def to_float8(model: nn.Module, recipe: str, *, blocks: nn.Module, device_type: str) -> int:
    """Convert the linear layers of ``blocks`` (``model``'s decoder blocks) to float8 training
    in place; returns how many."""
    if recipe not in RECIPES:
        raise ValueError(f"model.float8={recipe!r}: choose off, {' or '.join(RECIPES)}")
    check_device(device_type)

    quiet_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(convertible(model, blocks))
    if not chosen:
        raise ValueError("model.float8: this model's decoder blocks hold no nn.Linear layers "
                         "with dimensions that are multiples of 16; set model.float8=off")
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda m, name: name in chosen)
    return len(chosen)
