"""python -m raylm.bench NAME --output FILE.json [options]

    data      raylm's preparation (tokenize+pack) vs datasets.Dataset.map(num_proc=2)
    overhead  raylm single-worker training vs a bare PyTorch loop
    lora      LoRA (and QLoRA) vs full fine-tuning of one model, a Llama preset or a
              published family's shape: parameters, checkpoint, memory, speed
    mfu       one GPU: tokens/s, MFU, memory, J/token of raylm's step vs a bare loop
    float8    one GPU: raylm's step with float8 linears (tensorwise, rowwise) vs bf16:
              tokens/s, memory, loss after the same steps
    layouts   per-rank memory and step time under FSDP2, tensor and pipeline layouts
    context   sequences split over ranks (parallel.context): tokens/s, peak memory per rank,
              the all-to-all's bytes and time, by length; the longest within a memory cap
    comm      bytes FSDP2 gathers and reduces per step and rank, time in collectives and its
              share hidden behind compute, for parallel.reduce_dtype and parallel.prefetch;
              and DDP's all-reduce in fp32, bf16 and PowerSGD
    scale     preparation driver at 1x and 8x; bytes each rank reads per epoch; checkpoint
              bytes each resuming rank fetches; training time lost to a synchronous and an
              asynchronous checkpoint
    fault     a run uninterrupted, then with its workers SIGKILLed after a checkpoint: time
              lost, steps trained again, final losses
    startup   `raylm train` to the first step (starting Ray, or on a running head), a
              worker's SIGKILL to the next step, and one report's cost to the loop, by phase
    evals     a run's tokens/s without and with an lm-eval task scoring every checkpoint
              beside it
    prune     a trained run pruned by each method and sparsity: validation loss before and
              after, sizes; then healed by a short full and LoRA fine-tune
    gguf      a trained run as a GGUF file of each tensor type: size, export time, and the
              validation loss in llama.cpp against transformers'
    rl        a GRPO run synchronous and off-policy: the steps' time by part (training,
              generation, weight transfer), completions per second, the rewards reached
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raylm.bench")
    sub = p.add_subparsers(dest="name", required=True)
    _add_data_and_training(sub)
    _add_layouts_and_scale(sub)
    _add_context(sub)
    return p


def _add_data_and_training(sub) -> None:
    data = sub.add_parser("data", help="packed tokens/s: raylm pipeline vs datasets.map")
    data.add_argument("--output", required=True)
    data.add_argument("--packages", default="transformers,torch,ray,datasets,mlflow,peft",
                      help="installed packages whose docstrings form the corpus")
    data.add_argument("--files", type=int, default=8, help="JSONL shards the corpus is cut into")
    data.add_argument("--seq-len", type=int, default=256)
    data.add_argument("--num-proc", type=int, default=2, help="baseline processes")
    data.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    data.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    ov = sub.add_parser("overhead", help="training tokens/s: raylm (1 worker) vs bare PyTorch")
    ov.add_argument("--output", required=True)
    ov.add_argument("--preset", default="tiny")
    ov.add_argument("--steps", type=int, default=120)
    ov.add_argument("--micro-batch", type=int, default=8)
    ov.add_argument("--seq-len", type=int, default=256)
    ov.add_argument("--workdir", default=None)
    rl = sub.add_parser("rl", help="GRPO's time by part and completions/s: colocated, and "
                                   "generator actors synchronous vs off-policy")
    rl.add_argument("--output", required=True)
    rl.add_argument("--staleness", default="colocated,0,1",
                    help="the runs: colocated (rl.generators=0), or rl.max_staleness of one "
                         "with generator actors; the first is the baseline")
    rl.add_argument("--steps", type=int, default=60)
    rl.add_argument("--generators", type=int, default=1)
    rl.add_argument("--group-size", type=int, default=8)
    rl.add_argument("--max-completion-tokens", type=int, default=4)
    rl.add_argument("--workdir", default=None)
    ev = sub.add_parser("evals", help="training tokens/s without and with benchmark "
                                      "evaluations of every checkpoint beside the run")
    ev.add_argument("--output", required=True)
    ev.add_argument("--preset", default="tiny")
    ev.add_argument("--steps", type=int, default=200)
    ev.add_argument("--checkpoint-every", type=int, default=20)
    ev.add_argument("--questions", type=int, default=64)
    ev.add_argument("--cpus", type=int, default=1, help="CPUs of the training worker")
    ev.add_argument("--eval-cpus", type=float, default=1.0, help="CPUs of one evaluation")
    ev.add_argument("--eval-gpu", action="store_true", help="each evaluation on a GPU of its "
                                                             "own instead")
    ev.add_argument("--workdir", default=None)
    pr = sub.add_parser("prune", help="validation loss of a trained run before and after "
                                      "pruning, and after healing")
    pr.add_argument("--output", required=True)
    pr.add_argument("--preset", default="tiny")
    pr.add_argument("--steps", type=int, default=600, help="steps the run trains first")
    pr.add_argument("--vocab-size", type=int, default=1024, help="its tokenizer's vocabulary")
    pr.add_argument("--sparsities", default="0.25,0.5,2:4")
    pr.add_argument("--methods", default="magnitude,wanda")
    pr.add_argument("--heal-sparsity", default="0.5")
    pr.add_argument("--heal-steps", type=int, default=60)
    pr.add_argument("--workdir", default=None)
    gg = sub.add_parser("gguf", help="a trained run's GGUF files by tensor type: size and "
                                     "validation loss in llama.cpp against transformers'")
    gg.add_argument("--output", required=True)
    gg.add_argument("--run", required=True, help="a finished run directory whose prepared "
                                                 "data is on this machine")
    gg.add_argument("--types", default="f32,f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0")
    lo = sub.add_parser("lora", help="LoRA vs full fine-tuning: trainable parameters, "
                                     "checkpoint size, peak memory per worker, tokens/s")
    lo.add_argument("--output", required=True)
    lo.add_argument("--preset", default="125m", help="the fine-tuned model's architecture")
    lo.add_argument("--family", default=None,
                    help="a published shape instead of --preset: qwen3-1.7b, gemma3-1b "
                         "(qwen3-tiny, gemma3-tiny: the same families at a test size)")
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--qlora", action="store_true", help="also QLoRA (the base in NF4)")
    lo.add_argument("--sides", default="full,lora",
                    help="the sides to run, of full, lora, qlora, full_plain_loss (the plain "
                         "head's loss; ratios need full)")
    lo.add_argument("--seq-len", type=int, default=127)
    lo.add_argument("--compile", default="auto", help="model.compile: auto (on for CUDA), "
                                                      "true or false")
    lo.add_argument("--steps", type=int, default=6)
    lo.add_argument("--workers", type=int, default=2)
    lo.add_argument("--micro-batch", type=int, default=2)
    lo.add_argument("--workdir", default=None)


def _add_context(sub) -> None:
    cx = sub.add_parser("context", help="tokens/s, peak memory per rank and the all-to-all's "
                                        "bytes of sequences split over ranks (parallel."
                                        "context), by length (torch + transformers only)")
    cx.add_argument("--output", required=True)
    cx.add_argument("--presets", default="tiny,125m")
    cx.add_argument("--lengths", default="tiny:2048,8192,32768;125m:2048,4096",
                    help="sequence lengths, per preset (preset:a,b;preset:c) or for all")
    cx.add_argument("--contexts", default="1,2", help="degrees; the first is the baseline")
    cx.add_argument("--steps", type=int, default=3)
    cx.add_argument("--cap-gb", type=float, default=2.0,
                    help="the memory per rank the longest sequence must stay within")
    cx.add_argument("--documents", choices=("packed", "whole"), default="packed",
                    help="four documents per sequence attending within themselves, or one")
    cx.add_argument("--checkpointing", choices=("on", "off"), default="on",
                    help="activation checkpointing (off: every activation held at once)")
    cx.add_argument("--workdir", default=None)


def _add_layouts_and_scale(sub) -> None:
    mf = sub.add_parser("mfu", help="one GPU: raylm step vs bare PyTorch loop, MFU, "
                                    "memory, energy (torch + transformers only)")
    mf.add_argument("--output", required=True)
    mf.add_argument("--presets", default="125m,350m,1b")
    mf.add_argument("--seq-len", type=int, default=2048)
    mf.add_argument("--compile", default="off,on", help="off, on, or off,on (both)")
    mf.add_argument("--micro-batch", type=int, default=0,
                    help="first micro batch to try (0: per preset); halves on OOM")
    mf.add_argument("--warmup", type=int, default=8)
    mf.add_argument("--steps", type=int, default=20)
    mf.add_argument("--log-every", type=int, default=10)
    mf.add_argument("--profile", default=None, help="preset whose step kernels to list")
    mf.add_argument("--per-document", default=None,
                    help="preset to time per-document attention kernels on")
    mf.add_argument("--synced", action="store_true",
                    help="also time raylm's step reading loss and grad norm back every step")
    f8 = sub.add_parser("float8", help="one GPU: raylm step with float8 linears vs bf16 "
                                       "(torch, transformers, torchao)")
    f8.add_argument("--output", required=True)
    f8.add_argument("--presets", default="1b,3b")
    f8.add_argument("--recipes", default="tensorwise,rowwise")
    f8.add_argument("--seq-len", type=int, default=2048)
    f8.add_argument("--micro-batch", type=int, default=8,
                    help="first micro batch to try; halves while bf16 runs out of memory")
    f8.add_argument("--warmup", type=int, default=8)
    f8.add_argument("--steps", type=int, default=40)
    f8.add_argument("--log-every", type=int, default=8)
    la = sub.add_parser("layouts", help="per-rank parameter, optimizer and peak memory and "
                                        "step time of one model under each parallel layout "
                                        "(torch + transformers only)")
    la.add_argument("--output", required=True)
    la.add_argument("--preset", default="125m")
    la.add_argument("--layouts", default="dp2,tp2,pp2,dp4,dp2xtp2,dp2xpp2,tp2xpp2",
                    help="comma-separated; degrees dpN, tpN, ppN joined by x")
    la.add_argument("--seq-len", type=int, default=128)
    la.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    la.add_argument("--micro-batch", type=int, default=2)
    la.add_argument("--steps", type=int, default=3)
    la.add_argument("--workdir", default=None)
    co = sub.add_parser("comm", help="FSDP2's bytes, collective time and overlap per step "
                                     "and rank, by parallel.reduce_dtype and parallel.prefetch "
                                     "(torch + transformers only)")
    co.add_argument("--output", required=True)
    co.add_argument("--preset", default="tiny")
    co.add_argument("--workers", type=int, default=2)
    co.add_argument("--settings", default="default,reduce_bf16,prefetch1,prefetch2,ddp_fp32,"
                                          "ddp_bf16,ddp_powersgd1,ddp_powersgd4")
    co.add_argument("--seq-len", type=int, default=256)
    co.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    co.add_argument("--micro-batch", type=int, default=4)
    co.add_argument("--warmup", type=int, default=20)
    co.add_argument("--steps", type=int, default=5, help="profiled steps, after the warmup")
    co.add_argument("--workdir", default=None)
    sc = sub.add_parser("scale", help="what grows with the corpus and the cluster: the "
                                      "preparation driver's RSS and CPU at 1x and 8x, bytes "
                                      "each rank reads per epoch, bytes of a checkpoint each "
                                      "resuming rank fetches, time a checkpoint costs")
    sc.add_argument("--output", required=True)
    sc.add_argument("--parts", default="prepare,reads,checkpoint_fetch,async_checkpoint")
    sc.add_argument("--async-writers", default="thread,process",
                    help="where DCP writes the asynchronous checkpoints compared from: "
                         "thread, process or both")
    sc.add_argument("--packages", default="transformers,torch,ray,datasets,mlflow,peft",
                    help="installed packages whose docstrings form the prepare corpus")
    sc.add_argument("--preset", default="125m")
    sc.add_argument("--ranks", default="2,4", help="rank counts that save and resume")
    sc.add_argument("--workdir", default=None)
    st = sub.add_parser("startup", help="command to first step (cold and warm cluster), "
                                         "SIGKILL to the next step, one report's cost")
    st.add_argument("--output", required=True)
    st.add_argument("--workers", default="1,2", help="worker counts to run")
    st.add_argument("--steps", type=int, default=60)
    st.add_argument("--kill-after", type=int, default=20,
                    help="the recovery run's worker is killed after this step's checkpoint")
    st.add_argument("--tracking", choices=("on", "off"), default="on",
                    help="MLflow for the runs (off where MLflow is not installed)")
    st.add_argument("--workdir", default=None)
    fa = sub.add_parser("fault", help="time lost to a SIGKILLed worker, and the final loss "
                                      "against an uninterrupted run")
    fa.add_argument("--output", required=True)
    fa.add_argument("--config", default=None, help="the run's YAML (as raylm train --config)")
    fa.add_argument("--kill-after", type=int, default=20,
                    help="kill once a checkpoint at this step or later is verified")
    fa.add_argument("--delay", type=float, default=2.0,
                    help="seconds between that checkpoint and the kill")


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's options, and the config overrides ``fault`` passes to its runs (any
    other benchmark refuses words it does not know)."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and args.name != "fault":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.name == "scale" and not set(args.async_writers.split(",")) <= {"thread", "process"}:
        p.error(f"--async-writers={args.async_writers}: a comma-separated list of thread "
                f"and process")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(argv)
    quiet_console()
    result = measure(args, extra)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


def quiet_console() -> None:
    """A benchmark's console holds its own lines and its JSON: the libraries' progress bars
    (each model shard read or written, each MLflow artifact downloaded) are left out, here and
    in the processes it starts, which inherit the environment; a value the user set is kept.
    Before the libraries are imported: they read these once."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def measure(args: argparse.Namespace, extra: list[str]) -> dict:
    """The named benchmark's result."""
    # Each benchmark imports only what it runs: the GPU machines that run some of them have no
    # Ray, MLflow or datasets.
    if args.name == "data":
        from raylm.bench.data import run

        result = run(packages=args.packages.split(","), num_files=args.files,
                     seq_len=args.seq_len, num_proc=args.num_proc,
                     repeats=args.repeats, workdir=args.workdir)
    elif args.name == "startup":
        from raylm.bench.startup import run

        result = run(workers=[int(n) for n in args.workers.split(",")], steps=args.steps,
                     kill_after=args.kill_after, tracking=args.tracking == "on",
                     workdir=args.workdir)
    elif args.name == "overhead":
        from raylm.bench.overhead import run

        result = run(preset=args.preset, steps=args.steps, micro_batch=args.micro_batch,
                     seq_len=args.seq_len, workdir=args.workdir)
    elif args.name == "rl":
        from raylm.bench.rl import run

        result = run(staleness=[k if k == "colocated" else int(k)
                                for k in args.staleness.split(",")], steps=args.steps,
                     generators=args.generators, group_size=args.group_size,
                     max_completion_tokens=args.max_completion_tokens, workdir=args.workdir)
    elif args.name == "evals":
        from raylm.bench.evals import run

        result = run(preset=args.preset, steps=args.steps,
                     checkpoint_every=args.checkpoint_every, questions=args.questions,
                     cpus=args.cpus, eval_cpus=args.eval_cpus, eval_gpu=args.eval_gpu,
                     workdir=args.workdir)
    elif args.name == "prune":
        from raylm.bench.prune import run

        result = run(preset=args.preset, steps=args.steps, vocab_size=args.vocab_size,
                     sparsities=args.sparsities.split(","), methods=args.methods.split(","),
                     heal_steps=args.heal_steps, heal_sparsity=args.heal_sparsity,
                     workdir=args.workdir)
    elif args.name == "gguf":
        from raylm.bench.gguf import run

        result = run(run_dir=args.run, types=args.types.split(","))
    elif args.name == "lora":
        from raylm.bench.lora import run

        result = run(preset=args.preset, family=args.family, rank=args.rank, qlora=args.qlora,
                     steps=args.steps, workers=args.workers, micro_batch=args.micro_batch,
                     seq_len=args.seq_len, compile=args.compile, output=Path(args.output),
                     workdir=args.workdir, sides=tuple(args.sides.split(",")))
    elif args.name == "mfu":
        from raylm.bench.mfu import run

        result = run(presets=args.presets.split(","), seq_len=args.seq_len,
                     compile_modes=[m == "on" for m in args.compile.split(",")],
                     micro_batch=args.micro_batch, warmup=args.warmup, steps=args.steps,
                     log_every=args.log_every, profile_preset=args.profile,
                     per_document_preset=args.per_document, synced=args.synced)
    elif args.name == "float8":
        from raylm.bench.float8 import run

        result = run(presets=args.presets.split(","), recipes=args.recipes.split(","),
                     seq_len=args.seq_len, micro_batch=args.micro_batch, warmup=args.warmup,
                     steps=args.steps, log_every=args.log_every, output=args.output)
    elif args.name == "context":
        from raylm.bench.context import from_args
        result = from_args(args)
    elif args.name == "layouts":
        from raylm.bench.layouts import run

        result = run(preset=args.preset, layouts=args.layouts.split(","), seq_len=args.seq_len,
                     global_batch=args.global_batch, micro_batch=args.micro_batch,
                     steps=args.steps, workdir=args.workdir)
    elif args.name == "comm":
        from raylm.bench.comm import run

        result = run(preset=args.preset, workers=args.workers, settings=args.settings.split(","),
                     seq_len=args.seq_len, global_batch=args.global_batch,
                     micro_batch=args.micro_batch, warmup=args.warmup, steps=args.steps,
                     workdir=args.workdir)
    elif args.name == "scale":
        from raylm.bench.scale import run

        result = run(preset=args.preset, ranks=[int(n) for n in args.ranks.split(",")],
                     parts=args.parts.split(","), packages=args.packages.split(","),
                     workdir=args.workdir,
                     writers=tuple(args.async_writers.split(",")))
    elif args.name == "fault":
        from raylm.bench.fault import run
        from raylm.config import load_config
        from raylm.run.cluster import connect

        cfg = load_config(args.config, extra)
        connect(cfg.run.ray_address, log=print, timeout_s=cfg.run.connect_timeout_s)
        result = run(config=args.config, overrides=extra, kill_after=args.kill_after,
                     delay_s=args.delay)
    return result


if __name__ == "__main__":
    sys.exit(main())
