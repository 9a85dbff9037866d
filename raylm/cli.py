"""The ``raylm`` command. Its commands and options are the parser below (``raylm --help``;
docs/cli-reference.md is written from it).

Every command that runs something takes ``--config PATH`` and any ``--section.key=value``
override of :mod:`raylm.config`; the other flags say where and how (cluster address, job
environment), never what to train. User mistakes print one line and exit 2.

Each command imports what it runs inside its own function: importing torch, ray and
transformers takes seconds, which ``raylm config show`` and ``raylm jobs`` should not pay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from raylm import __version__
from raylm.config import Config, ConfigError, for_sweep, load_config
from raylm.contracts.events import Benchmark


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raylm",
        description="Elastic distributed language-model training on Ray.",
        epilog="config, prepare, train, tune and submit take any config key as "
               "--section.key=value (see `raylm config show` and docs/configuration-reference.md).",
        formatter_class=_Help,
    )
    p.add_argument("--version", action="version", version=f"raylm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(parent: argparse._SubParsersAction, name: str, help: str
                    ) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help, epilog=OVERRIDES_HELP,
                               formatter_class=_Help)
        sp.add_argument("--config", help="YAML config file (overrides win over it)")
        return sp

    def plain(parent: argparse._SubParsersAction, name: str, help: str
              ) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, description=help, formatter_class=_Help)

    cfg = sub.add_parser("config", help="inspect the resolved configuration")
    cfg_sub = cfg.add_subparsers(dest="action", required=True)
    with_config(cfg_sub, "show", "print the resolved config as YAML")

    prep = with_config(sub, "prepare",
                       "tokenize and pack data.source into Parquet blocks + manifest.json")
    prep.add_argument("--output", required=True, help="directory for the packed blocks")
    tr = with_config(sub, "train",
                     "train a model with FSDP2 on Ray Train (resumes a run of the same name)")
    tn = with_config(sub, "tune", "sweep the learning rate, schedule, warmup, weight decay, "
                                  "LoRA rank and alpha or DPO beta with Ray Tune, each trial a "
                                  "training run (resumes a sweep of the same name)")
    for sp in (tr, tn):
        sp.add_argument("--dry-run", action="store_true",
                        help="run the whole preflight without starting Ray: print the resolved "
                             "config and what would run where, then exit 0, or the refusal")
        sp.add_argument("--json", action="store_true",
                        help="at the end, print the run's summary (a sweep: its best trial) as "
                             "JSON on stdout, as summary.json (tune_summary.json) holds it")
    sb = with_config(sub, "submit", "run `raylm train` (or tune) as a job on a Ray cluster's "
                                    "job server and follow its logs")
    sb.add_argument("--address", help="job server, e.g. http://127.0.0.1:8265 (default: "
                                      "RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
    sb.add_argument("--command", dest="job_command", default="train", choices=["train", "tune"],
                    help="what the job runs")
    sb.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable for the job, e.g. MLFLOW_TRACKING_URI "
                         "(repeatable); not for secrets: Ray's job record shows a job's "
                         "environment, so set tokens in the nodes' environment")
    sb.add_argument("--pip", action="append", default=[], metavar="PKG",
                    help="extra pip package installed for the job (repeatable)")
    sb.add_argument("--image", help="container image the job runs in (runtime_env image_uri)")
    sb.add_argument("--no-code", action="store_true",
                    help="use the raylm installed on the cluster instead of shipping this one")
    sb.add_argument("--no-wait", action="store_true",
                    help="print the job id and return instead of following the logs")
    jb = plain(sub, "jobs", "list, inspect, follow or stop jobs on a Ray cluster")
    jb.add_argument("action", choices=["list", "status", "logs", "stop"])
    jb.add_argument("job", nargs="?", help="submission id (all but list)")
    jb.add_argument("--address", help="job server, e.g. http://127.0.0.1:8265 (default: "
                                      "RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
    jb.add_argument("--follow", action="store_true", help="logs: keep streaming until the "
                                                          "job ends")
    _add_exports(sub)
    ev = with_config(sub, "eval", "score a run's checkpoint (or every one) or an exported model "
                                  "on lm-evaluation-harness benchmarks: the run's own eval.* "
                                  "settings, or --eval.tasks=...")
    ev.add_argument("source", help="a run directory or an exported model directory")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="a run's checkpoint at this step (default: its "
                                                "latest usable one)")
    which.add_argument("--all", action="store_true", help="every usable checkpoint of the run")
    gen = plain(sub, "generate", "sample text from a run directory or exported model")
    gen.add_argument("source", help="a run directory or an exported model directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--chat", help="a user message to answer, rendered with the chat template "
                                    "fine-tuning used")
    gen.add_argument("--system", help="with --chat: a system message before it")
    gen.add_argument("--max-new-tokens", type=int, default=64,
                     help="tokens to sample at most (fewer where the model ends its text)")
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="sampling temperature; 0 for greedy decoding")
    gen.add_argument("--seed", type=int, default=0,
                     help="seed of the sampling (the same seed, the same text)")
    return p


def _add_exports(sub: argparse._SubParsersAction) -> None:
    """``export`` and ``prune``: what a finished run is turned into."""
    about = ("write a run's latest checkpoint as a Hugging Face model directory (a LoRA run: a "
             "peft adapter directory, or with --merge the merged model), or a GGUF file")
    ex = sub.add_parser("export", help=about, description=about, formatter_class=_Help)
    ex.add_argument("run_dir", help="the run directory (run.storage_path/run.name)")
    ex.add_argument("--output", required=True, help="directory for the exported model (with "
                    "--format gguf, a name ending in .gguf is the file itself)")
    ex.add_argument("--merge", action="store_true",
                    help="LoRA runs: write the base with the adapters merged in, instead of a "
                         "PEFT adapter directory")
    ex.add_argument("--format", default="hf", choices=["hf", "gguf"],
                    help="hf: a Hugging Face directory; gguf: one GGUF file that llama.cpp runs "
                         "(LoRA runs are merged first)")
    ex.add_argument("--quantize", choices=["int8", "f16", "q8_0", "f32", "q6_k", "q5_k_m",
                                           "q4_k_m", "q4_0"],
                    help="hf: int8 weight-only linear layers (torchao; LoRA runs are merged "
                         "first), printing the size and validation-loss change; gguf: the "
                         "tensor type, f16 (default), q8_0 or f32, or llama.cpp's quantizer's "
                         "q6_k, q5_k_m, q4_k_m or q4_0 (the llamacpp extra)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an earlier raylm export of another kind in --output (a "
                         "directory raylm did not write is never replaced)")
    about = ("write a pruned copy of a run's model (or a model directory), with each layer's "
             "sparsity and the validation loss before and after")
    pr = sub.add_parser("prune", help=about, description=about, formatter_class=_Help)
    pr.add_argument("source", help="a run directory, or a model directory (wanda then needs "
                                   "--data)")
    pr.add_argument("--output", required=True, help="directory for the pruned model")
    pr.add_argument("--sparsity", required=True,
                    help="the fraction of each layer's weights to zero (0.5), or 2:4 (two of "
                         "every four consecutive weights kept, what sparse tensor cores run)")
    pr.add_argument("--method", default="wanda", choices=["wanda", "magnitude"],
                    help="wanda: |weight| x the norm of its input over calibration data; "
                         "magnitude: |weight|")
    pr.add_argument("--data", help="prepared data (raylm prepare's output) for calibration and "
                                   "the losses; default: the run's own")
    pr.add_argument("--calibration-blocks", type=int, default=32,
                    help="wanda: how many training blocks calibrate it")
    pr.add_argument("--overwrite", action="store_true",
                    help="replace an earlier raylm export of another kind in --output")


OVERRIDES_HELP = """\
Every config key is also an option: --section.key=value (or --section.key value), for
example --train.steps=100 --scaling.num_workers=2. Overrides win over --config, which wins
over the defaults. `raylm config show` lists every key with its resolved value; the
configuration reference (docs/configuration-reference.md) gives each key's type, default and
meaning."""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default where it has one worth saying (not None, False or
    an empty list), and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and "%(default)" not in text
                and default is not None and default is not False
                and default is not argparse.SUPPRESS and default not in ("", [])):
            text += " (default: %(default)s)"
        return text


WHY_NO_OVERRIDES = {
    "export": "it writes what the run trained, with the run's own config (see raylm export "
              "--help for its options).",
    "prune": "it prunes what the run trained, with the run's own config (see raylm prune "
             "--help for its options).",
    "generate": "it samples from what the run trained, with the run's own config (see raylm "
                "generate --help for its options).",
    "jobs": "it inspects jobs already submitted; give settings to raylm submit.",
}

# Errors are printed in one line; a longer one is cut to what a screen holds.
MAX_ERROR_CHARS = 1000


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``--a.b=c`` / ``--a.b c`` overrides from ordinary arguments."""
    rest, overrides = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if "." in name:
            if "=" not in a:
                # `--train.steps --config x` must not read `--config` as the step count.
                if i + 1 == len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"Override {a} has no value: write {a}=VALUE.")
                a = f"{a}={args[i + 1]}"
                i += 1
            overrides.append(a)
        else:
            rest.append(a)
        i += 1
    return rest, overrides


def _say(message: str) -> None:
    print(message, flush=True)


def cmd_prepare(cfg: Config, args: argparse.Namespace) -> int:
    from raylm import api

    manifest = api.prepare(cfg, output=args.output)
    print(json.dumps({k: v for k, v in manifest.items() if k != "bad_records"}, indent=2))
    print(f"wrote {args.output}/manifest.json")
    return 0


def cmd_train(cfg: Config, args: argparse.Namespace) -> int:
    """``raylm train`` and ``raylm tune``: the run ends in a few lines a person reads; with
    ``--json``, its summary (the sweep's best trial) follows as JSON for a script."""
    from raylm import api

    sweep = args.command == "tune"
    if args.dry_run:
        return dry_run(cfg, sweep=sweep)
    result = api.tune(cfg).best if sweep else api.train(cfg).summary
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """``raylm eval``: the scores in lines as they come, and as JSON at the end."""
    from raylm.after.evaluate import evaluate_source

    other = [o for o in overrides if not o.startswith("--eval.")]
    if other:
        raise ConfigError(f"raylm eval takes the eval.* keys only, and {other[0]} would change "
                          f"nothing: it scores what a run already trained.")
    ev = load_config(args.config, overrides).eval if (args.config or overrides) else None
    records = evaluate_source(args.source, ev, step=args.step, every=args.all)
    print(json.dumps([{"step": r.step, "scores": getattr(r, "scores", None),
                       "error": getattr(r, "error", None)} for r in records], indent=2))
    return 0 if all(isinstance(r, Benchmark) for r in records) else 1


def dry_run(cfg: Config, *, sweep: bool) -> int:
    """The resolved config, then what the run would do where (:mod:`raylm.run.dryrun`)."""
    from raylm.run.dryrun import describe

    checked, lines = describe(cfg, sweep=sweep)
    sys.stdout.write(checked.to_yaml())
    for line in lines:
        print(f"raylm: dry run: {line}")
    print("raylm: dry run: the preflight passed; nothing was started")
    return 0


def cmd_submit(cfg: Config, args: argparse.Namespace) -> int:
    from raylm.run.submit import parse_env, submit

    if cfg.run.ray_address:
        raise ValueError(f"run.ray_address={cfg.run.ray_address!r} is set, but a submitted job "
                         f"runs on the cluster's head and joins that cluster itself; unset it.")
    if args.job_command == "tune":
        from raylm.run.preflight import check_sweep

        # The rest of the preflight runs in the job, where the model and data paths are.
        check_sweep(cfg)
        cfg = for_sweep(cfg)  # the job and its sweep carry one name
    _, status = submit(cfg, address=args.address, command=args.job_command,
                       env=parse_env(args.env), pip=args.pip, image=args.image,
                       ship_code=not args.no_code, wait=not args.no_wait,
                       out=_say)
    return 0 if status in (None, "SUCCEEDED") else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    from raylm.run import submit

    jobs = submit.client(args.address)
    if args.action == "list":
        print(submit.table(submit.list_rows(jobs)))
        return 0
    if not args.job:
        raise ValueError(f"raylm jobs {args.action} needs a submission id (see raylm jobs "
                         f"list).")
    try:
        # An unknown id must fail in one line (the job server answers 404).
        info = jobs.get_job_info(args.job)
    except RuntimeError as e:
        raise ValueError(f"job {args.job!r}: {e} (see raylm jobs list)") from None
    if args.action == "status":
        print(json.dumps({"id": args.job, "status": str(info.status.value),
                          "message": info.message, "entrypoint": info.entrypoint,
                          "metadata": info.metadata, "start_time_ms": info.start_time,
                          "end_time_ms": info.end_time}, indent=2))
        return 0
    if args.action == "logs":
        if args.follow:
            return 0 if submit.follow(jobs, args.job) == "SUCCEEDED" else 1
        sys.stdout.write(jobs.get_job_logs(args.job))
        return 0
    status = submit.stop(jobs, args.job)
    print(f"raylm: {args.job} {status}")
    return 0 if status in submit.TERMINAL else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        rest, overrides = _split_overrides(argv)
    except ConfigError as e:
        return _error(e)
    args = _parser().parse_args(rest)
    if overrides and args.command in ("export", "prune", "generate", "jobs"):
        # They act on what a run already wrote (or on a cluster's jobs): a config key given
        # here would change nothing, and silence would let the user think it did.
        return _error(ConfigError(
            f"raylm {args.command} takes no config overrides, and {overrides[0]} would change "
            f"nothing: {WHY_NO_OVERRIDES[args.command]}"))
    try:
        if args.command == "export":
            from raylm import api

            out = api.export(args.run_dir, args.output, merge=args.merge,
                             quantize=args.quantize, format=args.format,
                             overwrite=args.overwrite)
            print(f"exported to {out}")
            return 0
        if args.command == "prune":
            from raylm import api

            api.prune(args.source, args.output, sparsity=args.sparsity, method=args.method,
                      data=args.data, calibration_blocks=args.calibration_blocks,
                      overwrite=args.overwrite)
            print(f"pruned model written to {args.output}")
            return 0
        if args.command == "generate":
            from raylm import api

            if args.system is not None and args.chat is None:
                raise ValueError("--system goes with --chat (a conversation to answer).")
            text = api.generate(args.source, args.prompt, chat=args.chat, system=args.system,
                                max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed)
            print(text if args.chat is not None else args.prompt + text)
            return 0
        if args.command == "jobs":
            return cmd_jobs(args)
        if args.command == "eval":
            return cmd_eval(args, overrides)
        cfg = load_config(args.config, overrides)
        if args.command == "config":
            sys.stdout.write(cfg.to_yaml())
            return 0
        if args.command == "prepare":
            return cmd_prepare(cfg, args)
        if args.command in ("train", "tune"):
            return cmd_train(cfg, args)
        if args.command == "submit":
            return cmd_submit(cfg, args)
    except (ValueError, FileNotFoundError) as e:
        # ConfigError, SourceError, BadRecordError and tokenizer errors: one line, no trace.
        return _error(e)
    raise AssertionError(args.command)


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``raylm`` command as a process of its own: the console script, ``python -m raylm``
    and the scripts in jobs/ (:func:`main` is for callers that go on afterwards, like tests).

    Its exit skips the interpreter's teardown, which frees every module and object one by one:
    with torch, transformers and Ray loaded that took 1.3 s after a dry run and 2.0 s after a
    training run here, after the command's last line, for a process about to end (and a job's
    status waits for it). What must run at exit still does, in its order: the exit handlers
    (Ray's disconnect and its last log lines, MLflow's and logging's flushes), after any
    thread Python would wait for has ended, as at a normal exit."""
    # As `python -m raylm` does: modules of the directory it runs in (a reward's) import.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    if not isinstance(code, int) or any(
            t.is_alive() and not t.daemon and t is not threading.main_thread()
            for t in threading.enumerate()):
        sys.exit(code)

    from raylm.compat import _run_exitfuncs

    sys.stdout.flush()
    sys.stderr.flush()
    _run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _error(e: Exception) -> int:
    text = " ".join(str(e).split("\n"))
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}... ({len(text):,} characters in all)"
    print(f"raylm: error: {text}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    run()
