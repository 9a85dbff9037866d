"""The ``raylm`` command.

    raylm config show [--config PATH] [--section.key=value ...]
    raylm prepare [--config PATH] [--section.key=value ...] --output DIR
    raylm train [--config PATH] [--section.key=value ...]
    raylm tune [--config PATH] [--section.key=value ...]
    raylm export RUN_DIR --output DIR
    raylm generate RUN_DIR|MODEL_DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T]

Every command takes ``--config PATH`` and any ``--section.key=value`` override of
:mod:`raylm.config`; nothing else is a flag. User mistakes print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from raylm.config import Config, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raylm",
        description="Elastic distributed language-model training on Ray.",
        epilog="Any config key can be set as --section.key=value (see `raylm config show`).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="YAML config file (CLI overrides win over it)")
        return sp

    cfg = sub.add_parser("config", help="inspect the resolved configuration")
    cfg_sub = cfg.add_subparsers(dest="action", required=True)
    with_config(cfg_sub.add_parser("show", help="print the resolved config as YAML"))

    prep = with_config(sub.add_parser(
        "prepare", help="tokenize and pack data.source into Parquet blocks + manifest.json"))
    prep.add_argument("--output", required=True, help="directory for the packed blocks")
    with_config(sub.add_parser(
        "train", help="train a model with FSDP2 on Ray Train (resumes a run of the same name)"))
    with_config(sub.add_parser(
        "tune", help="sweep learning-rate schedules with Ray Tune, each trial a training run "
                     "(resumes a sweep of the same name)"))
    ex = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face "
                                       "model directory")
    ex.add_argument("run_dir", help="the run directory (run.storage_path/run.name)")
    ex.add_argument("--output", required=True, help="directory for the exported model")
    gen = sub.add_parser("generate", help="sample text from a run directory or exported model")
    gen.add_argument("source", help="a run directory or an exported model directory")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--seed", type=int, default=0)
    return p


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``--a.b=c`` / ``--a.b c`` overrides from ordinary arguments."""
    rest, overrides = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if "." in name:
            if "=" not in a and i + 1 < len(args):
                a = f"{a}={args[i + 1]}"
                i += 1
            overrides.append(a)
        else:
            rest.append(a)
        i += 1
    return rest, overrides


def _init_ray(address: str | None) -> None:
    import logging

    import ray

    if not ray.is_initialized():
        # Warnings and up from Ray itself; raylm prints its own progress.
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)


def cmd_prepare(cfg: Config, args: argparse.Namespace) -> int:
    from raylm.corpus import resolve_sources
    from raylm.data import prepare

    d = cfg.data
    # Resolve sources before starting Ray: a missing path fails in a second, not after init.
    resolve_sources(d.source, builtin_packages=d.builtin_packages, hf_split=d.hf_split)
    _init_ray(cfg.run.ray_address)
    manifest = prepare(cfg, args.output, log=lambda m: print(m, flush=True))
    print(json.dumps({k: v for k, v in manifest.items() if k != "bad_records"}, indent=2))
    print(f"wrote {args.output}/manifest.json")
    return 0


def cmd_train(cfg: Config, args: argparse.Namespace) -> int:
    from raylm.launch import train

    _init_ray(cfg.run.ray_address)
    summary = train(cfg, log=lambda m: print(m, flush=True))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_tune(cfg: Config, args: argparse.Namespace) -> int:
    from raylm.tune import check_sweep, sweep

    check_sweep(cfg)  # before Ray starts
    _init_ray(cfg.run.ray_address)
    summary = sweep(cfg, log=lambda m: print(m, flush=True))
    print(json.dumps(summary["best"], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rest, overrides = _split_overrides(argv)
    args = _parser().parse_args(rest)
    try:
        if args.command == "export":
            from raylm.export import export

            print(f"exported to {export(args.run_dir, args.output)}")
            return 0
        if args.command == "generate":
            from raylm.export import generate

            print(args.prompt + generate(args.source, args.prompt,
                                         max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, seed=args.seed))
            return 0
        cfg = load_config(args.config, overrides)
        if args.command == "config":
            sys.stdout.write(cfg.to_yaml())
            return 0
        if args.command == "prepare":
            return cmd_prepare(cfg, args)
        if args.command == "train":
            return cmd_train(cfg, args)
        if args.command == "tune":
            return cmd_tune(cfg, args)
    except (ValueError, FileNotFoundError) as e:
        # ConfigError, SourceError, BadRecordError and tokenizer errors: one line, no trace.
        print(f"raylm: error: {e}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
