"""``raylm prune``: a pruned copy of a run's model (or of a model directory), measured::

    raylm prune runs/my-run --output pruned/ --method wanda --sparsity 0.5
    raylm prune runs/my-run --output pruned-24/ --sparsity 2:4
    raylm prune base-model/ --data prepared/ --output pruned/ --method wanda --sparsity 0.5

What is zeroed, and how it is chosen, is :mod:`raylm.model.sparsity`. Wanda's calibration
batches are the first blocks of the prepared *training* split (``--calibration-blocks``), and
the validation loss before and after is measured on the blocks the run's own evaluations read,
so the figure is not taken on the data the scores were calibrated on.

The output is a Hugging Face model directory that loads anywhere: its weights are stored dense
(safetensors has no sparse tensors), with the zeros in place, and ``raylm_export.json`` holds
the report (method, target, each layer's sparsity, the losses, the sizes). Fine-tuning it with
raylm (``model.path`` set to it) keeps the zeros zero; a LoRA fine-tune's merged export too.
Runs on this process's CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from raylm import rundir, storage
from raylm.config import Config, config_from_dict
from raylm.console import quiet_model_io, quiet_torchao
from raylm.contracts import EXPORT_INFO, LAYOUT, RUN_INFO, ExportInfo
from raylm.data.streams import read_first_blocks, read_val_blocks
from raylm.formats.exporter import (
    batched,
    load_run_model,
    model_losses,
    stored_bytes,
    validation_batches,
)
from raylm.model import sparsity
from raylm.model.assemble import Built, batch_loss
from raylm.outputs import building, check_output, publish
from raylm.run import tracking
from raylm.rundir import read_run_info

DEFAULT_CALIBRATION_BLOCKS = 32


def prune_source(source: str | Path, output: str | Path, *, sparsity_text: str,
                 method: str = "wanda", data: str | None = None,
                 calibration_blocks: int = DEFAULT_CALIBRATION_BLOCKS,
                 overwrite: bool = False, log=print) -> dict[str, Any]:
    """Prune ``source`` (a run directory's newest checkpoint, merged if LoRA, or a model
    directory) to ``sparsity_text`` (a fraction, or ``2:4``) by ``method`` and write it to
    ``output``; returns the report written beside it."""
    target = sparsity.parse_target(sparsity_text)
    if method not in sparsity.METHODS:
        raise ValueError(f"--method {method}: not one of {', '.join(sparsity.METHODS)}")
    if calibration_blocks < 1:
        raise ValueError(f"--calibration-blocks {calibration_blocks}: give at least 1")
    src = storage.normalize(source)
    is_run = storage.is_file(storage.join(src, RUN_INFO))
    if storage.is_uri(src) or not (is_run or Path(src, "config.json").is_file()):
        raise ValueError(f"{src} is neither a raylm run directory nor a model directory on "
                         f"this machine (config.json).")
    cfg = config_from_dict(read_run_info(src).config) if is_run else Config()
    prepared = data or (read_run_info(src).prepared if is_run else None)
    if data is not None and not Path(data, LAYOUT).is_file():
        raise ValueError(f"--data {data}: not prepared data (no {LAYOUT}); give the "
                         f"directory `raylm prepare` wrote.")
    if prepared is not None and not Path(prepared, LAYOUT).is_file():
        if method == "wanda":
            raise ValueError(f"the run's prepared data ({prepared}) is not on this machine: "
                             f"give --data PREPARED_DIR (prepared with the run's tokenizer), "
                             f"or use --method magnitude.")
        prepared = None
    if method == "wanda" and prepared is None:
        raise ValueError(f"--method wanda scores weights by the activations of calibration "
                         f"data: give --data PREPARED_DIR (what `raylm prepare` wrote with "
                         f"the tokenizer of {src}), or use --method magnitude.")
    inputs = [("the source", src)]
    if cfg.model.path:
        inputs.append(("the base model (model.path)", cfg.model.path))
    out = check_output(output, what="--output", marker=EXPORT_INFO, key="kind",
                       inputs=inputs, kind=sparsity.PRUNED_KIND, overwrite=overwrite)
    with building(out) as tmp:
        report = _write_pruned(src, tmp, cfg=cfg, is_run=is_run, own_data=data is None,
                               prepared=prepared, target=target, method=method,
                               calibration_blocks=calibration_blocks, log=log)
    publish(tmp, out, mine=(EXPORT_INFO, "kind"))
    if is_run:
        _track(src, report, out, log)
    return report


def _write_pruned(src: str, out: Path, *, cfg: Config, is_run: bool, own_data: bool,
                  prepared: str | None, target: sparsity.Target, method: str,
                  calibration_blocks: int, log) -> dict[str, Any]:
    quiet_torchao()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    with quiet_model_io():
        if is_run:
            model, tokenizer_dir, step = load_run_model(src)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                src, trust_remote_code=False, dtype=torch.float32).eval()
            tokenizer_dir, step = Path(src), None
    _check_vocabulary(model, prepared)
    # The run's own evaluation blocks, unless other data was given.
    if is_run and own_data:
        val = validation_batches(src, log=log)
    elif prepared is not None:
        micro = cfg.train.micro_batch_size
        blocks = read_val_blocks(prepared, rank=0, world_size=1,
                                 eval_samples=cfg.train.eval_batches * micro)
        val = batched(blocks, micro), cfg.data.across_documents
    else:
        val = None
    dense_bytes = _param_bytes(model)
    before = model_losses([model], *val)[0] if val else None
    calibrate = None
    if method == "wanda":
        micro = cfg.train.micro_batch_size
        batches = batched(read_first_blocks(prepared, "train", count=calibration_blocks), micro)
        cross = cfg.data.across_documents
        built = Built.on_cpu(model, cross)

        def forward(_, batch):
            batch_loss(built, batch, cross_document=cross)

        model.config.use_cache = False
        calibrate = sparsity.calibration_runner(model, batches, forward)
    with torch.no_grad():
        layers = sparsity.prune(model, target, method=method, calibrate=calibrate)
    after = model_losses([model], *val)[0] if val else None
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    tok.save_pretrained(str(out))
    pruned = sum(r["shape"][0] * r["shape"][1] for r in layers)
    zeros = sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in layers)
    total = sum(p.numel() for p in model.parameters())
    report = {
        "kind": sparsity.PRUNED_KIND, "source": src, "step": step, "method": method,
        "sparsity": target.label, "calibration_blocks": calibration_blocks
        if method == "wanda" else None,
        "pruned_layers": len(layers), "pruned_share_of_weights": round(pruned / total, 4),
        "layer_sparsity": round(zeros / pruned, 6), "model_sparsity": round(zeros / total, 6),
        "val_loss_before": before, "val_loss": after,
        "bytes": stored_bytes(out), "dense_bytes": dense_bytes,
        "compressed_bytes": _compressed_bytes(model, layers, target),
        "seconds": round(time.perf_counter() - t0, 1), "layers": layers,
    }
    (out / EXPORT_INFO).write_text(ExportInfo(kind=sparsity.PRUNED_KIND, step=step, details={
        k: v for k, v in report.items() if k not in ("kind", "step")}).to_json())
    line = (f"pruned {len(layers)} layers ({report['pruned_share_of_weights']:.0%} of the "
            f"weights) to {target.label} by {method}: {zeros / total:.1%} of the model is zero")
    if before is not None:
        line += f"; validation loss {before:.4f} -> {after:.4f} ({after - before:+.4f})"
    log(line)
    return report


def _check_vocabulary(model, prepared: str | None) -> None:
    """The prepared tokens must be the model's: a block holding an id past its vocabulary was
    made with another tokenizer."""
    if prepared is None:
        return
    first = read_first_blocks(prepared, "train", count=8)["input_ids"]
    vocab = model.get_input_embeddings().weight.shape[0]
    if first.size and int(first.max()) >= vocab:
        raise ValueError(f"--data {prepared}: its blocks hold token id {int(first.max())}, past "
                         f"the model's vocabulary of {vocab}; prepare the data with the "
                         f"model's tokenizer (raylm prepare --model.path=MODEL_DIR, "
                         f"tokenizer.path unset).")


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _compressed_bytes(model, layers: list[dict], target: sparsity.Target) -> int:
    """What the weights would take with each pruned layer stored sparse: 2:4 as the sparse
    tensor cores read it (half the values, and 2 bits of position per kept value), any other
    sparsity as a bitmask (1 bit per weight) and the kept values. Computed, not written:
    safetensors stores dense tensors."""
    size = next(model.parameters()).element_size()
    dense = _param_bytes(model)
    for r in layers:
        n = r["shape"][0] * r["shape"][1]
        kept = round(n * (1 - r["sparsity"]))
        sparse = kept * size + (kept * 2 // 8 if target.m else n // 8)
        dense -= n * size - sparse
    return dense


def _track(run_dir: str, report: dict[str, Any], out: Path, log) -> None:
    """The report in the run's MLflow run: the losses and sparsity as metrics at the step
    pruned, named by method and target, and the whole report as an artifact."""
    summary = rundir.read_summary(run_dir)
    if summary is not None:
        tracking.run_tracker(run_dir, summary, log=log).log_pruning(
            {**report, "output": str(out)})
