"""From a run directory to a Hugging Face model directory, and sampling text from either.

A run directory describes itself: ``RUN_DIR/run.json`` (the resolved config, vocabulary and
EOS id) and the tokenizer's copy in ``RUN_DIR/tokenizer``. Export loads the newest verified
checkpoint on one process, as a worker loads it (:mod:`raylm.model.assemble` builds the
model, ``raylm.workers.checkpoint`` gathers the shards of any world size), and writes what
``from_pretrained`` loads. ``--quantize int8`` is torchao's weight-only int8 through
transformers' ``TorchAoConfig`` (linear layers and the head, one scale per output row; the
embedding table stays: a lookup costs memory, not compute), and the export measures what
decides whether to ship it: the size, and the validation-loss change on the run's own
validation blocks, scored by the assembly's ``evaluate`` as the run scored them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from raylm import rundir, storage
from raylm.config import config_from_dict
from raylm.console import quiet_model_io, quiet_torchao
from raylm.contracts import EXPORT_INFO, LAYOUT, RUN_INFO, ExportInfo, RunInfo
from raylm.data.chat import (
    DEFAULT_VERSION,
    DefaultTemplate,
    encode,
    generation_prompt,
    pair_segments,
    template_args,
    template_for,
)
from raylm.data.corpus import normalize, parse_pair
from raylm.data.preparation import string_prompts, template_version
from raylm.data.streams import PackedSplit, eval_samples_per_rank, read_val_blocks
from raylm.data.tokenizer import load_tokenizer
from raylm.formats import llamacpp
from raylm.model import lora, sparsity
from raylm.model.assemble import Built, evaluate
from raylm.model.build import max_positions
from raylm.model.spec import ModelSpec
from raylm.outputs import OutputError, building, check_output, publish
from raylm.rundir import read_run_info, read_summary
from raylm.workers import checkpoint

TOKENIZER_DIR = "tokenizer"
# In RUN_DIR/tokenizer, written after its files: their digest (see write_run_info).
TOKENIZER_DIGEST = ".raylm-tokenizer"


QUANTIZATIONS = ("int8",)
FORMATS = ("hf", "gguf")


def _redacted(value):
    """``value`` with credentials in URIs (a storage path's keys, a tracking URI's password)
    replaced: run.json is read back for the model's settings, never for where things are."""
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return storage.redact(value) if isinstance(value, str) and "://" in value else value


def write_run_info(run_dir: str, *, config: dict, vocab_size: int, eos_id: int,
                   tokenizer_path: str, prepared: str) -> None:
    storage.write_text(storage.join(run_dir, RUN_INFO), RunInfo(
        config=_redacted(config), vocab_size=vocab_size, eos_id=eos_id, prepared=prepared,
        default_template=template_version(run_dir),
        string_prompts=string_prompts(run_dir)).to_json())
    # The tokenizer's own files only: it is often a whole model directory (model.path's),
    # whose weights must not travel with every run, nor land in its exports. Written at every
    # start whose tokenizer differs from the one there (a resume with accept_changes: [tokenizer],
    # a copy cut short by a killed driver), its digest last: a copy without it is partial.
    target = storage.join(run_dir, TOKENIZER_DIR)
    if Path(target).is_symlink():  # emptied below: never another folder through a link
        raise ValueError(f"{target} is a link; remove it (raylm writes a run's tokenizer there)")
    with tempfile.TemporaryDirectory(prefix="raylm-tokenizer-") as tmp:
        load_tokenizer(tokenizer_path, config["model"]["path"]).save_pretrained(tmp)
        files = sorted(f for f in Path(tmp).iterdir() if f.is_file())
        digest = hashlib.blake2b(b"".join(f.name.encode() + b"\0" + f.read_bytes()
                                          for f in files), digest_size=16).hexdigest()
        mark = storage.join(target, TOKENIZER_DIGEST)
        if storage.is_file(mark) and storage.read_text(mark) == digest:
            return
        storage.remove(mark)
        if storage.is_dir(target):
            for name in storage.list_files(target):
                storage.remove(storage.join(target, name))
        storage.upload(tmp, target)
        storage.write_text(mark, digest)


def load_run_model(run_dir: str | Path, *, merge: bool = True,
                   checkpoint_path: str | None = None):
    """(model in eval mode, local tokenizer directory, step) from a run's newest verified
    checkpoint (or ``checkpoint_path``'s, verified). A LoRA run's adapters are merged into the base
    unless ``merge`` is false. A run in object storage has its tokenizer fetched to a
    temporary directory."""

    rd = storage.normalize(run_dir)
    info = read_run_info(rd)
    cfg = config_from_dict(info.config)
    found = (rundir.latest_usable(rd, bad=rundir.read_manifest(rd)["bad_checkpoints"])
             if checkpoint_path is None
             else (checkpoint_path, rundir.verify(checkpoint_path)))
    if found is None:
        raise ValueError(f"{rd} holds no complete checkpoint to export.")
    args = lora.adapter_args(cfg.lora)
    built = ModelSpec.from_config(cfg, vocab_size=info.vocab_size,
                                  eos_id=info.eos_id).for_checkpoint()
    model = built.model
    checkpoint.load(found[0], model=model, optimizer=None, config=built.config,
                    adapters=lora.settings(cfg.lora))
    if args and merge:
        lora.merge_adapters(model, keep_zeros=sparsity.is_pruned(cfg.model.path))
    model.eval()
    tokenizer_dir = storage.join(rd, TOKENIZER_DIR)
    if storage.is_uri(rd):
        tokenizer_dir = str(storage.download(tokenizer_dir,
                                             tempfile.mkdtemp(prefix="raylm-tokenizer-")))
    return model, Path(tokenizer_dir), found[1].step


def export(run_dir: str | Path, output: str | Path, *, merge: bool = False,
           quantize: str | None = None, format: str = "hf", overwrite: bool = False,
           log=print) -> Path:
    """Write the run's newest checkpoint where plain clients use it as it is: a full model as
    a Hugging Face directory (KV cache on, EOS and padding named, the tokenizer's length limit
    the model's positions); a LoRA run as peft's adapter directory, or with ``merge`` the
    merged model; the tokenizer and its chat template with either. ``quantize="int8"``: int8
    weights, with what that changed logged. ``format="gguf"``: one GGUF file for llama.cpp in
    ``quantize`` f16 (default), q8_0 or f32 (:mod:`raylm.formats.llamacpp`), in a directory,
    or as ``output`` itself when its name ends in ``.gguf``. Built beside ``output`` and
    renamed into place; :func:`raylm.outputs.check_output` says which ``output`` is refused
    (``overwrite``: an earlier export of another kind is not)."""
    if format not in FORMATS:
        raise ValueError(f"--format {format}: not one of {', '.join(FORMATS)}")
    quiet_torchao()  # before the model's imports bring torchao in
    cfg = config_from_dict(read_run_info(storage.normalize(run_dir)).config)
    if format == "gguf":
        quantize = gguf_settings(run_dir, cfg, quantize)
        kind = f"gguf-{quantize}"
    elif quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"--quantize {quantize}: not one of {', '.join(QUANTIZATIONS)} (the "
                         f"others are GGUF's: add --format gguf)")
    else:
        adapters = bool(lora.adapter_args(cfg.lora))
        kind = (f"model-{quantize}" if quantize else
                "lora-adapter" if adapters and not merge else "model")
    if format == "gguf" and str(output).endswith(".gguf"):
        return _gguf_file(run_dir, output, cfg, quantize, log=log)
    inputs = [] if storage.is_uri(run_dir) else [("the run directory", run_dir)]
    if cfg.model.path:
        inputs.append(("the base model (model.path)", cfg.model.path))
    out = check_output(output, what="--output", marker=EXPORT_INFO, key="kind", inputs=inputs,
                       kind=kind, overwrite=overwrite)
    with building(out) as tmp:
        if format == "gguf":
            _write_gguf(run_dir, tmp, cfg, quantize, f"model-{quantize}.gguf", log=log)
        elif quantize is not None:
            _write_quantized(run_dir, tmp, cfg, quantize, log=log)
        else:
            write_export(run_dir, tmp, cfg, merge=merge)
    publish(tmp, out, mine=(EXPORT_INFO, "kind"))
    return out


def gguf_settings(run_dir: str | Path, cfg, quantize: str | None) -> str:
    """The GGUF export's tensor type, once the run's model family, rotary embedding and
    tokenizer are known to be ones raylm writes for llama.cpp (refused here, before anything
    is written or loaded)."""
    if not importlib.util.find_spec("gguf"):
        raise ValueError("--format gguf needs the gguf package: pip install 'raylm[gguf]'")
    quantize = quantize or "f16"
    if quantize not in (*llamacpp.QUANTIZATIONS, *llamacpp.BY_LLAMA_CPP):
        raise ValueError(f"--quantize {quantize}: GGUF exports are one of "
                         f"{', '.join((*llamacpp.QUANTIZATIONS, *llamacpp.BY_LLAMA_CPP))}")
    if quantize in llamacpp.BY_LLAMA_CPP and not importlib.util.find_spec("llama_cpp"):
        raise ValueError(f"--quantize {quantize} is llama.cpp's own quantizer: pip install "
                         f"'raylm[llamacpp]' (or export q8_0, which needs only gguf)")
    info = read_run_info(storage.normalize(run_dir))
    config = ModelSpec.from_config(cfg, vocab_size=info.vocab_size,
                                   eos_id=info.eos_id).transformers_config()
    arch = llamacpp.check_model(config.to_dict())
    tokenizer = storage.join(storage.normalize(run_dir), TOKENIZER_DIR, "tokenizer.json")
    llamacpp.pre_tokenizer(json.loads(storage.read_text(tokenizer)), arch)
    return quantize


def _gguf_file(run_dir: str | Path, output: str | Path, cfg, quantize: str, *, log) -> Path:
    """``--output NAME.gguf``: that file, where none stands or the one there is an earlier
    raylm export (its metadata holds :data:`raylm.formats.llamacpp.RECORD`); built beside it
    and renamed into place."""
    from gguf import GGUFReader

    out = Path(output).expanduser().resolve()
    try:
        ours = "://" not in str(output) and (not out.exists()
                                             or llamacpp.RECORD in GGUFReader(out).fields)
    except (OSError, ValueError):  # a folder, or not a GGUF file
        ours = False
    if not ours:
        raise OutputError(f"--output {output}: raylm writes a GGUF file where none stands or "
                          f"where its own earlier export does (not a URI, a folder or another "
                          f"file); choose a new local file name.")
    with building(out) as tmp:
        _write_gguf(run_dir, tmp, cfg, quantize, out.name, log=log)
        (tmp / out.name).replace(out)
    shutil.rmtree(tmp)
    return out


def _write_gguf(run_dir: str | Path, out: Path, cfg, quantize: str, name: str, *, log) -> None:
    """The GGUF export of :func:`export`, into the empty directory ``out`` (the file's
    ``name`` and its record beside it): the merged model written as a Hugging Face directory
    first, then converted."""
    with tempfile.TemporaryDirectory(prefix="raylm-export-") as tmp:
        plain = Path(tmp) / storage.name(storage.normalize(run_dir))
        plain.mkdir()
        write_export(run_dir, plain, cfg, merge=True)
        info = dataclasses.replace(ExportInfo.read(plain), kind=f"gguf-{quantize}")
        record = {"run_dir": info.run_dir, "kind": info.kind, "step": info.step}
        report = llamacpp.write_gguf(plain, out / name, quantize=quantize, record=record)
    info.details = {"file": name, **report}
    (out / EXPORT_INFO).write_text(info.to_json())
    types = ", ".join(f"{n} {t}" for t, n in report["tensor_types"].items())
    log(f"GGUF ({report['architecture']}, {quantize}): {name}, {report['bytes'] / 2**20:.1f} MiB "
        f"(tensors: {types})")


def write_export(run_dir: str | Path, out: Path, cfg, *, merge: bool,
                 checkpoint_path: str | None = None) -> None:
    """The export of :func:`export` (not quantized), into the empty directory ``out``; of
    ``checkpoint_path`` rather than the newest checkpoint (a benchmark's:
    :mod:`raylm.run.benchmarks`)."""
    from transformers import AutoTokenizer

    adapters = lora.adapter_args(cfg.lora)
    model, tokenizer_dir, step = load_run_model(run_dir, merge=merge or not adapters,
                                                checkpoint_path=checkpoint_path)
    model.config.use_cache = True
    gen = model.generation_config
    gen.use_cache = True
    gen.eos_token_id = gen.pad_token_id = model.config.eos_token_id
    if adapters and not merge:
        _save_adapters(model, cfg, out)
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    # Saved by the tokenizer itself, so only its files are written (runs recorded before that
    # rule kept a whole model directory as their tokenizer).
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    tok.model_max_length = max_positions(model.config)
    version = template_version(storage.normalize(run_dir))
    if template_args(tok) is None:
        # Trained with raylm's default template: carried as the tokenizer's own, so that
        # transformers, vLLM, llama.cpp (the GGUF's tokenizer.chat_template) and lm-eval
        # render a conversation as training did.
        tok.chat_template = DefaultTemplate(version).jinja
    tok.save_pretrained(str(out))
    (out / EXPORT_INFO).write_text(ExportInfo(
        run_dir=storage.normalize(run_dir), step=step,
        kind="lora-adapter" if adapters and not merge else "model",
        default_template=version, string_prompts=string_prompts(run_dir)).to_json())


def _write_quantized(run_dir: str | Path, out: Path, cfg, method: str, *, log) -> None:
    """The int8 export of :func:`export`, into the empty directory ``out``."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    with tempfile.TemporaryDirectory(prefix="raylm-export-") as tmp:
        plain = Path(tmp)
        write_export(run_dir, plain, cfg, merge=True)
        full = AutoModelForCausalLM.from_pretrained(tmp, trust_remote_code=False).eval()
        # A tied output head is the embedding table: untie it, or quantizing the head would
        # hand the embedding lookup an int8 tensor.
        tied = bool(full.config.tie_word_embeddings)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, trust_remote_code=False, quantization_config=TorchAoConfig(
                Int8WeightOnlyConfig(), include_input_output_embeddings=True,
                untie_embedding_weights=tied)).eval()
        model.save_pretrained(str(out), safe_serialization=True)
        for f in plain.iterdir():
            if f.name not in {"config.json", "generation_config.json"} and \
                    not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
        sizes = [stored_bytes(plain), stored_bytes(out)]
        losses = _validation_losses(run_dir, [full, model], log=log)
    report = {"quantization": f"{method} weight-only (torchao)",
              "unquantized_bytes": sizes[0], "bytes": sizes[1]}
    line = (f"{method} weight-only: {sizes[1] / 2**20:.1f} MiB against {sizes[0] / 2**20:.1f} "
            f"MiB unquantized ({sizes[1] / sizes[0]:.2f}x)")
    if losses:
        report.update(unquantized_val_loss=losses[0], val_loss=losses[1])
        line += (f"; validation loss {losses[0]:.4f} -> {losses[1]:.4f} "
                 f"({losses[1] - losses[0]:+.4f})")
    info = ExportInfo.read(out)
    info.kind, info.details = f"model-{method}", {**info.details, **report}
    (out / EXPORT_INFO).write_text(info.to_json())
    log(line)


def stored_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _validation_losses(run_dir: str | Path, models: list, *, log) -> list[float]:
    """Each model's loss on the run's validation blocks (as training evaluates: the same
    blocks, masked targets for fine-tuning data); empty, with the reason logged, when the run's
    prepared data is not on this machine."""
    found = validation_batches(run_dir, log=log)
    return [] if found is None else model_losses(models, *found)


def validation_batches(run_dir: str | Path, *, log
                       ) -> tuple[list[dict[str, torch.Tensor]], bool] | None:
    """(batches, whether documents attend across each other) of the blocks the run's last
    evaluation read; None, with the reason logged, when its prepared data is not here."""
    info = read_run_info(storage.normalize(run_dir))
    prepared = info.prepared
    if not prepared or not Path(prepared, LAYOUT).is_file():
        log(f"validation loss not compared: the run's prepared data "
            f"({prepared or 'its path is not in run.json'}) is not on this machine")
        return None
    cfg = config_from_dict(info.config)
    # Each of the run's W workers took its share of the first blocks in storage order, so one
    # reader taking W shares reads the same ones, and the unchanged model's figure is the
    # run's own final validation loss.
    summary = read_summary(storage.normalize(run_dir))
    workers = (summary and summary.workers) or cfg.scaling.worker_range[0]
    micro = cfg.train.micro_batch_size
    per_rank = eval_samples_per_rank(PackedSplit.load(prepared, "val"), workers,
                                     cfg.train.eval_batches * micro)
    blocks = read_val_blocks(prepared, rank=0, world_size=1, eval_samples=per_rank * workers)
    return batched(blocks, micro), cfg.data.across_documents


def batched(blocks: dict[str, np.ndarray], micro: int) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.from_numpy(v[i:i + micro]) for k, v in blocks.items()}
            for i in range(0, len(blocks["input_ids"]), micro)]


def model_losses(models: list, batches: list[dict[str, torch.Tensor]], cross_document: bool
                 ) -> list[float]:
    """Each model's mean validation loss on ``batches``, on the CPU in fp32, as a worker
    evaluates."""
    for m in models:
        # As in training: with a KV cache transformers ignores the per-document positions and
        # lets documents attend to each other.
        m.config.use_cache = False
    return [evaluate(Built.on_cpu(m, cross_document), batches, cross_document=cross_document)
            for m in models]


def _save_adapters(model: torch.nn.Module, cfg, out: Path) -> None:
    """The trained adapters as peft writes them: a PeftModel on the base (from model.path),
    given raylm's adapter weights (the injected layers have the same names), saved by peft."""
    quiet_torchao()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lo = cfg.lora
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, trust_remote_code=False)
    peft_model = get_peft_model(base, LoraConfig(
        r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
        target_modules=lora.resolve_targets(base, lo.target_modules), bias="none"))
    trained = {n: p for n, p in model.state_dict().items() if lora.ADAPTER_MARK in n}
    result = peft_model.base_model.model.load_state_dict(trained, strict=False)
    if result.unexpected_keys or any(lora.ADAPTER_MARK in k for k in result.missing_keys):
        raise RuntimeError(f"adapter names do not match peft's: {result.unexpected_keys[:3]} "
                           f"{[k for k in result.missing_keys if lora.ADAPTER_MARK in k][:3]}")
    peft_model.save_pretrained(str(out))


class Generator:
    """A model loaded once (from a run directory or a model directory) to sample from many
    times: continuations of text, or answers to conversations rendered as fine-tuning rendered
    them (the tokenizer's chat template, else raylm's default; see :mod:`raylm.data.chat`)."""

    def __init__(self, source: str | Path) -> None:
        quiet_torchao()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = storage.normalize(source)
        if storage.is_file(storage.join(src, RUN_INFO)):
            with quiet_model_io():
                self.model, tok_dir, _ = load_run_model(src)
            version, self.strings = template_version(src), string_prompts(src)
        elif storage.is_file(storage.join(src, "config.json")) and not storage.is_uri(src):
            self.model, tok_dir = AutoModelForCausalLM.from_pretrained(
                str(src), trust_remote_code=False).eval(), src
            # A raylm export says the rules it was trained with (an older one, the older
            # rules); a model raylm did not write gets the newest.
            info = ExportInfo.read(src) or ExportInfo(
                kind="model", default_template=DEFAULT_VERSION, string_prompts="as_written")
            version, self.strings = info.default_template, info.string_prompts
        else:
            raise ValueError(f"{src} is neither a raylm run directory nor an exported model.")
        self.tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
        self.template = template_for(self.tok, version)

    def complete(self, prompt: str, **sampling) -> str:
        # A control token's string in the prompt is ordinary text, as in training text.
        ids = self.tok(prompt, return_tensors="pt", add_special_tokens=False,
                       split_special_tokens=True)["input_ids"]
        return self._sample(ids, **sampling)

    def answer(self, messages: list[dict[str, str]], **sampling) -> str:
        """The assistant's answer to ``messages`` (which end with a user turn)."""
        messages = [{"role": m["role"], "content": normalize(m["content"])} for m in messages]
        ids = generation_prompt(messages, self.tok.backend_tokenizer, self.template,
                                eos_id=self.tok.eos_token_id)
        answer = self._sample(torch.from_numpy(ids.astype("int64"))[None], **sampling)
        return answer.removeprefix(getattr(self.template, "answer_prefix", ""))

    @torch.no_grad()
    def answer_logp(self, prompt: list[dict[str, str]] | str,
                    answer: list[dict[str, str]] | str) -> float:
        """The summed log-probability of ``answer``'s trained tokens after ``prompt``, rendered
        as preference training renders a pair's half (:func:`raylm.data.chat.pair_segments`,
        by the rule the model was trained with: a string prompt as written, or one user turn in
        a run started before that rule)."""
        pair, bad = parse_pair(prompt, {"answer": answer}, self.strings)
        if bad:
            raise ValueError(f"answer_logp: the prompt or its answer is {bad}")
        ids, mask = encode(pair_segments(self.template, pair["prompt"], pair["answer"]),
                           self.tok.backend_tokenizer, eos_id=self.tok.eos_token_id,
                           loss_on="assistant")
        tokens = torch.from_numpy(ids.astype("int64"))[None]
        logp = torch.log_softmax(self.model(input_ids=tokens[:, :-1]).logits.float(), dim=-1)
        picked = logp[0].gather(-1, tokens[0, 1:, None])[:, 0]
        return float(picked[torch.from_numpy(mask[1:].astype(bool))].sum())

    @torch.no_grad()
    def _sample(self, ids: torch.Tensor, *, max_new_tokens: int = 64, temperature: float = 0.8,
                top_k: int = 50, seed: int = 0) -> str:
        if ids.shape[1] == 0:
            ids = torch.tensor([[self.tok.eos_token_id]])
        torch.manual_seed(seed)
        out = self.model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_k=top_k,
            pad_token_id=self.tok.eos_token_id, use_cache=True)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def generate(source: str | Path, prompt: str = "", *, chat: str | None = None,
             system: str | None = None, max_new_tokens: int = 64, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> str:
    """Sample a continuation of ``prompt`` from a run directory or an exported model; or, with
    ``chat``, the answer to that user message, after the ``system`` message if given (see
    :class:`Generator`)."""
    g = Generator(source)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    seed=seed)
    if chat is not None:
        system_turn = [] if system is None else [{"role": "system", "content": system}]
        return g.answer([*system_turn, {"role": "user", "content": chat}], **sampling)
    return g.complete(prompt, **sampling)
