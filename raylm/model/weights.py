"""A Hugging Face model directory's weights, read into a model raylm built: checked against
the model before any is read, read once (rank 0, or each pipeline stage its own) and scattered
into the possibly sharded model, with transformers' own loading where it converts a family's
files (mixture-of-experts experts stored apart).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raylm.model.build import WeightsError, canonical_name, reset_buffers


def stored_weight_names(path: str | os.PathLike) -> set[str]:
    """The tensor names in a Hugging Face model directory's ``*.safetensors`` files (headers
    only: nothing is read but the index at each file's start)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"model.path: {path} holds no .safetensors weights.")
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt", device="cpu") as handle:
            names.update(handle.keys())
    return names


def _stored_against_model(model: nn.Module, path: str | os.PathLike
                          ) -> tuple[list[str], list[str]]:
    """(weights the model needs that the files lack, tensors the files hold that the model
    does not have), by name."""
    stored = stored_weight_names(path)
    needed = {canonical_name(n) for n, _ in model.named_parameters() if ".lora_" not in n}
    # Every name a stored tensor may rightly have: tied weights under each of their names, and
    # buffers some checkpoints keep (rotary frequencies, attention masks).
    known = {canonical_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {canonical_name(n) for n, _ in model.named_buffers()}
    return sorted(needed - stored), sorted(stored - known)


def converted_on_load(config) -> bool:
    """Whether transformers converts this family's checkpoints while loading them (mixture-of-
    experts files store each expert's projections apart; the model holds them fused)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return bool(get_checkpoint_conversion_mapping(config.model_type))


def check_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Refuse a model directory whose weight files do not hold exactly the model's weights
    (every one its config makes, tied ones once), before any is read. Loading skips what it
    does not expect and fills what it finds: without this, an incomplete directory left
    weights unset and trained on garbage. A family whose files transformers converts on load
    is checked by that load instead (see :func:`load_pretrained_weights`)."""
    missing, unexpected = _stored_against_model(model, path)
    if (missing or unexpected) and not converted_on_load(model.config):
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} weights the model needs ({', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"holds {len(unexpected)} the model does not have "
                         f"({', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''})")
        raise WeightsError(
            f"model.path: {path} {' and '.join(parts)}: the directory's weights are not this "
            f"model's (an incomplete download, or another model's files).")


def _weights_as_transformers_loads(model: nn.Module, path: str | os.PathLike
                                   ) -> dict[str, torch.Tensor]:
    """The weights of ``path`` as transformers loads them, its conversions applied (mixture-of-
    experts projections fused), under the names of ``model``'s parameters. One full copy on
    the reading rank, as reading the files is."""
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype="auto", trust_remote_code=False, output_loading_info=True)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise WeightsError(f"model.path: {path} lacks {len(missing)} weights the model "
                           f"needs ({', '.join(missing[:3])}): an incomplete download?")
    wanted = {n.replace(".base_layer.", "."): n for n, _ in model.named_parameters()}
    return {wanted[k]: v for k, v in loaded.state_dict().items() if k in wanted}


def load_pretrained_weights(model: nn.Module, path: str | os.PathLike, *,
                            own_stage: bool = False, alone: bool = False) -> None:
    """Read a Hugging Face model directory's weights on rank 0 only and scatter them into the
    (possibly sharded) ``model``: one read from storage, not one per worker. With
    ``own_stage`` (a pipeline stage, holding part of the model) every rank reads the weights
    of its own stage instead, so no rank reads or receives another stage's; ``alone`` (a
    whole model of this process's, inside a process group), every rank reads them all."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reader = not dist.is_initialized() or dist.get_rank() == 0 or own_stage or alone
    full: dict[str, torch.Tensor] = {}
    if reader and converted_on_load(model.config) and any(_stored_against_model(model, path)):
        full = _weights_as_transformers_loads(model, path)
    elif reader:
        if not own_stage:
            check_weights(model, path)
        files = sorted(Path(path).glob("*.safetensors"))
        wanted = {n.replace(".base_layer.", "."): n for n, _ in model.named_parameters()}
        for f in files:
            with safe_open(str(f), "pt", device="cpu") as handle:
                # A LoRA layer holds the pretrained weight as `base_layer`.
                full.update({wanted.get(k, k): handle.get_tensor(k) for k in handle.keys()
                             if k in wanted or not own_stage})
    if reader:
        # A tied weight is stored once (as the input embeddings) but has a name in the model
        # for each module that holds it; every name gets the one tensor.
        shared: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(param), []).append(name)
        for names in shared.values():
            stored = next((n for n in names if n in full), None)
            if stored is not None:
                for n in names:
                    full.setdefault(n, full[stored])
    # Adapters are not in the file (raylm.model.lora fills them); every other weight must be.
    adapters = any(".lora_" in n for n, _ in model.named_parameters())
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True,
        broadcast_from_rank0=dist.is_initialized() and not (own_stage or alone),
        strict=not adapters))
    if adapters and reader:
        missing = [n for n, _ in model.named_parameters() if ".lora_" not in n and n not in full
                   and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing:
            raise WeightsError(f"model.path: {path} lacks {', '.join(missing[:5])}")
    reset_buffers(model)
