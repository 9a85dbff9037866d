"""From a run directory to a Hugging Face model directory, and sampling text from either.

A run directory is self-describing: ``raylm train`` writes ``RUN_DIR/run.json`` (the resolved
config, vocabulary and EOS id) and a copy of the tokenizer in ``RUN_DIR/tokenizer``. Export loads
the newest verified checkpoint on one process (DCP gathers the shards of any world size into
full tensors) and writes ``config.json``, ``model.safetensors`` and the tokenizer files, which
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from raylm import checkpoint, lora, storage
from raylm.config import config_from_dict
from raylm.model import build_config, build_meta_model, max_positions, reset_buffers

RUN_INFO = "run.json"
TOKENIZER_DIR = "tokenizer"


def write_run_info(run_dir: str, *, config: dict, vocab_size: int, eos_id: int,
                   tokenizer_path: str) -> None:
    storage.write_text(storage.join(run_dir, RUN_INFO), json.dumps(
        {"config": config, "vocab_size": vocab_size, "eos_id": eos_id}, indent=1))
    target = storage.join(run_dir, TOKENIZER_DIR)
    if not storage.is_dir(target):
        storage.upload(tokenizer_path, target)


def read_run_info(run_dir: str) -> dict:
    """``RUN_DIR/run.json``: the resolved config, vocabulary and EOS id."""
    if not storage.is_file(storage.join(run_dir, RUN_INFO)):
        raise ValueError(f"{run_dir} is not a raylm run directory (no {RUN_INFO}); pass the "
                         f"directory `raylm train` printed as its run dir.")
    return json.loads(storage.read_text(storage.join(run_dir, RUN_INFO)))


def load_run_model(run_dir: str | Path, *, merge: bool = True):
    """(model in eval mode, local tokenizer directory, step) from a run's newest verified
    checkpoint. A LoRA run's adapters are merged into the base unless ``merge`` is false. A run
    in object storage has its tokenizer fetched to a temporary directory."""

    rd = storage.normalize(run_dir)
    info = read_run_info(rd)
    cfg = config_from_dict(info["config"])
    found = checkpoint.latest_verified(rd)
    if found is None:
        raise ValueError(f"{rd} holds no complete checkpoint to export.")
    config = build_config(preset=cfg.model.preset, path=cfg.model.path,
                          vocab_size=info["vocab_size"], eos_id=info["eos_id"],
                          attn_implementation="sdpa")
    model = build_meta_model(config)
    args = lora.adapter_args(cfg.lora)
    if args:
        model = lora.add_adapters(model, **args)
    model.to_empty(device="cpu")
    reset_buffers(model)  # rotary frequencies are not in checkpoints
    if args:
        # A LoRA checkpoint holds the adapters; the frozen base is the pretrained model's.
        checkpoint.load_pretrained_weights(model, cfg.model.path)
    state = checkpoint.load(found[0], model=model, optimizer=None, config=config,
                            adapters=lora.settings(cfg.lora))
    if args and merge:
        lora.merge_adapters(model)
    model.eval()
    tokenizer_dir = storage.join(rd, TOKENIZER_DIR)
    if storage.is_uri(rd):
        tokenizer_dir = str(storage.download(tokenizer_dir,
                                             tempfile.mkdtemp(prefix="raylm-tokenizer-")))
    return model, Path(tokenizer_dir), int(state["step"])


def export(run_dir: str | Path, output: str | Path, *, merge: bool = False) -> Path:
    """Write the run's newest checkpoint as a directory plain clients use as it is.

    A full model: a Hugging Face model directory (``from_pretrained``, ``generate``,
    ``pipeline``), with the KV cache on (training turns it off; without it every new token
    re-runs the whole sequence), EOS and padding named, and the tokenizer's length limit set to
    the model's positions. A LoRA run: a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``, written by peft itself) that ``PeftModel.from_pretrained``
    loads onto the base model, or, with ``merge``, the merged model as a full directory. The
    tokenizer (with its chat template, if any) goes with either."""
    from transformers import AutoTokenizer

    cfg = config_from_dict(read_run_info(storage.normalize(run_dir))["config"])
    adapters = lora.adapter_args(cfg.lora)
    model, tokenizer_dir, step = load_run_model(run_dir, merge=merge or not adapters)
    out = Path(output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    gen = model.generation_config
    gen.use_cache = True
    gen.eos_token_id = gen.pad_token_id = model.config.eos_token_id
    if adapters and not merge:
        _save_adapters(model, cfg, out)
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.model_max_length = max_positions(model.config)
    tok.save_pretrained(str(out))
    (out / "raylm_export.json").write_text(json.dumps(
        {"run_dir": storage.normalize(run_dir), "step": step,
         "kind": "lora-adapter" if adapters and not merge else "model"}, indent=1))
    return out


def _save_adapters(model: torch.nn.Module, cfg, out: Path) -> None:
    """The trained adapters as peft writes them: a PeftModel on the base (from model.path),
    given raylm's adapter weights (the injected layers have the same names), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lo = cfg.lora
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    peft_model = get_peft_model(base, LoraConfig(
        r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
        target_modules=list(lo.target_modules), bias="none"))
    trained = {n: p for n, p in model.state_dict().items() if lora.ADAPTER_MARK in n}
    result = peft_model.base_model.model.load_state_dict(trained, strict=False)
    if result.unexpected_keys or any(lora.ADAPTER_MARK in k for k in result.missing_keys):
        raise RuntimeError(f"adapter names do not match peft's: {result.unexpected_keys[:3]} "
                           f"{[k for k in result.missing_keys if lora.ADAPTER_MARK in k][:3]}")
    peft_model.save_pretrained(str(out))


class Generator:
    """A model loaded once (from a run directory or a model directory) to sample from many
    times: continuations of text, or answers to conversations rendered as fine-tuning rendered
    them (the tokenizer's chat template, else raylm's default; see :mod:`raylm.chat`)."""

    def __init__(self, source: str | Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from raylm.chat import template_for

        src = storage.normalize(source)
        if storage.is_file(storage.join(src, RUN_INFO)):
            self.model, tok_dir, _ = load_run_model(src)
        elif storage.is_file(storage.join(src, "config.json")) and not storage.is_uri(src):
            self.model, tok_dir = AutoModelForCausalLM.from_pretrained(str(src)).eval(), src
        else:
            raise ValueError(f"{src} is neither a raylm run directory nor an exported model.")
        self.tok = AutoTokenizer.from_pretrained(str(tok_dir))
        self.template = template_for(self.tok)

    def complete(self, prompt: str, **sampling) -> str:
        ids = self.tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        return self._sample(ids, **sampling)

    def answer(self, messages: list[dict[str, str]], **sampling) -> str:
        """The assistant's answer to ``messages`` (which end with a user turn)."""
        from raylm.chat import generation_prompt
        from raylm.corpus import normalize

        messages = [{"role": m["role"], "content": normalize(m["content"])} for m in messages]
        ids = generation_prompt(messages, self.tok.backend_tokenizer, self.template,
                                eos_id=self.tok.eos_token_id)
        return self._sample(torch.from_numpy(ids.astype("int64"))[None], **sampling)

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
             max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0) -> str:
    """Sample a continuation of ``prompt`` from a run directory or an exported model; or, with
    ``chat``, the answer to that user message (see :class:`Generator`)."""
    g = Generator(source)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    seed=seed)
    if chat is not None:
        return g.answer([{"role": "user", "content": chat}], **sampling)
    return g.complete(prompt, **sampling)
