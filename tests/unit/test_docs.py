"""The documentation site builds (strict: a broken link, anchor or page left out of the
navigation fails it), its configuration reference names every key of the config dataclasses,
and no page names a key that does not exist."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.config import Config

ROOT = Path(__file__).resolve().parents[2]
# Names that look like config keys and are not: a `raylm.Run`'s attributes (written `run.X`),
# the misspelled key the configuration page shows being refused, a model's modules, files.
NOT_KEYS = {"run.history", "run.summary", "run.checkpoint", "run.config", "run.mlflow_run_id",
            "train.stpes",
            # a Hugging Face decoder's modules
            "model.embed_tokens", "model.layers", "model.norm",
            # a transformers tokenizer's method, and a GGUF file's metadata key
            "tokenizer.apply_chat_template", "tokenizer.chat_template"}
FILE_SUFFIXES = (".py", ".json", ".md", ".yaml", ".jsonl", ".npy", ".ipynb")


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "configuration-reference" / "index.html").is_file()
    assert (tmp_path / "notebooks" / "04_lora_fine_tune" / "index.html").is_file()


def test_the_configuration_reference_names_every_key_and_only_those():
    reference = hooks().reference()
    named = set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", reference, flags=re.M))
    assert named == set(Config().flat())


def test_no_page_names_a_key_that_does_not_exist():
    keys = set(Config().flat())
    sections = sorted({k.split(".")[0] for k in keys})
    key = re.compile(rf"(?<![\w./-])(?:--)?({'|'.join(sections)})\.([a-z_][a-z0-9_]*)"
                     rf"(?![\w/-]|\.[a-z])")
    unknown = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        fence = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.M | re.S)
        blocks = fence.findall(text)
        spans = re.findall(r"`([^`\n]+)`", fence.sub("", text))
        for code in [*blocks, *spans]:
            for m in key.finditer(code):
                name = f"{m.group(1)}.{m.group(2)}"
                if name in keys or name in NOT_KEYS or name.endswith(FILE_SUFFIXES):
                    continue
                unknown.append(f"{page.name}: {name}")
    assert not unknown, unknown


# The jobs/ entry points, as the raylm command each of them runs.
RAYLM_WRAPPERS = {"jobs/pretrain.py": ["train"], "jobs/prepare.py": ["prepare"],
                  "jobs/sweep.py": ["tune"]}


def _standin_rows(fmt: str) -> list[dict]:
    """A few rows of ``fmt``, where a page names the reader's own file (chats.jsonl)."""
    from raylm.examples.reverse_words import SYSTEM

    rows = []
    for words in (["river", "mill", "bread"], ["tea", "salt"], ["king", "queen", "horse"]) * 8:
        ask = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": "Reverse the words: " + " ".join(words)}]
        answer = " ".join(reversed(words))
        rows.append({"chat": {"messages": [*ask, {"role": "assistant", "content": answer}]},
                     "preference": {"prompt": ask, "chosen": answer, "rejected": " ".join(words)},
                     "prompt_completion": {"prompt": ask[1]["content"], "completion": answer},
                     }.get(fmt, {"text": f"{ask[1]['content']} {answer}."}))
    return rows


def _stand_in_inputs(cfg) -> str | None:
    """Make what a reader brings (their own data file, their own lm-eval tasks) where the
    page names one that is not there; a model directory must come from an earlier command.
    Returns a problem, if any."""
    from raylm.hub import is_hub_id

    d, m = cfg.data, cfg.model
    for source in [d.source] if isinstance(d.source, str) else d.source:
        if source == "builtin" or source.startswith("hf:"):
            continue
        path = Path(source.split("*", 1)[0] + "standin.jsonl" if "*" in source else source)
        if not path.exists() and path.suffix == ".jsonl":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in _standin_rows(d.format)))
    if m.path and not is_hub_id(m.path) and not Path(m.path).exists():
        return f"model.path {m.path} is made by no command before it"
    tasks = cfg.eval.include_path
    if tasks and not Path(tasks).exists():
        # The reader's own lm-eval tasks: each named one, over a two-question JSONL file.
        Path(tasks).mkdir(parents=True)
        (Path(tasks) / "rows.jsonl").write_text(
            '{"q": "one", "choices": ["a", "b"], "answer": 0}\n'
            '{"q": "two", "choices": ["a", "b"], "answer": 1}\n')
        for name in cfg.eval.tasks:
            (Path(tasks) / f"{name}.yaml").write_text(
                f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {Path(tasks).resolve() / 'rows.jsonl'}\ntest_split: test\n"
                "output_type: multiple_choice\ndoc_to_text: \"{{q}}\"\n"
                "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
                "metric_list:\n  - metric: acc\n")
    return None


def _check(c, sandbox: Path, capsys) -> str | None:
    """None if the command ``c`` parses (and, where it can, preflights) as its page says;
    else what is wrong."""
    import os

    from raylm import cli
    from raylm.config import load_config
    from tests.conftest import save_tiny_llama

    words = [os.path.expandvars(w.replace("$PWD", str(sandbox))) for w in c.argv]
    if words[0].startswith("python"):
        target = words[2] if words[1] == "-m" else words[1]
        rest = words[3:] if words[1] == "-m" else words[2:]
        if target in RAYLM_WRAPPERS:
            words = ["raylm", *RAYLM_WRAPPERS[target], *rest]
        elif target in ("raylm", "raylm.cli"):
            words = ["raylm", *rest]
        else:
            parser = {"raylm.bench": "raylm.bench.__main__",
                      "raylm.examples.reverse_words": "raylm.examples.reverse_words",
                      "raylm.examples.larger_digit": "raylm.examples.larger_digit",
                      "raylm.examples.arithmetic": "raylm.examples.arithmetic"}.get(target)
            if parser is None:
                return f"no parser known for {target}"
            import importlib

            module = importlib.import_module(parser)
            try:
                if target == "raylm.bench":
                    args, extra = module.parse(rest)
                    if extra:  # fault's config overrides
                        load_config(args.config, extra)
                else:
                    args = module.parser().parse_args(rest)
            except SystemExit as e:
                return None if e.code == 0 else f"refused: {capsys.readouterr().err.strip()}"
            except ValueError as e:
                return f"refused: {e}"
            if target.startswith("raylm.examples.") and args.command in ("write", "model") \
                    and not Path(args.output).exists() and not c.inline:
                module.main(rest)  # cheap, and what the next commands read
            return None
    words = words[1:]
    capsys.readouterr()
    if c.refusal is not None:
        code = cli.main(words)
        err = capsys.readouterr().err
        if code != 2 or not err.startswith("raylm: error: " + c.refusal):
            return f"promises the refusal {c.refusal!r}, got exit {code}: {err.strip()}"
        return None
    try:
        rest, overrides = cli._split_overrides(words)
        args = cli._parser().parse_args(rest)
    except SystemExit as e:
        return None if e.code == 0 else f"refused: {capsys.readouterr().err.strip()}"
    except ValueError as e:
        return f"refused: {e}"
    if args.command in ("export", "prune", "generate", "jobs"):
        if overrides:
            return f"{args.command} takes no config overrides ({overrides[0]})"
        if args.command in ("export", "prune") and not Path(args.output).exists():
            save_tiny_llama(Path(args.output), vocab_size=300)  # the model the run would be
        return None
    try:
        cfg = load_config(args.config, overrides)
        if args.command == "tune" or getattr(args, "job_command", None) == "tune":
            from raylm.run.preflight import check_sweep

            check_sweep(cfg)
    except ValueError as e:
        return f"refused: {e}"
    if args.command not in ("train", "tune") or c.needs or c.inline:
        return None
    problem = _stand_in_inputs(cfg)
    if problem:
        return problem
    if cli.main([*words, "--dry-run"]) != 0:
        return f"its dry run is refused: {capsys.readouterr().err.strip()}"
    return None


def test_every_documented_command_parses_and_preflights_as_written(tmp_path, monkeypatch,
                                                                   capsys, ray_never_starts):
    """Every command of README.md, docs/*.md and the jobs/configs headers, in page order, in a
    reader's fresh checkout (this repository's jobs/, nothing else): parsed by the real
    parsers; a config's keys loaded; a sweep's settings checked; ``raylm train`` and ``raylm
    tune`` dry-run (the whole preflight) unless the page marks what they need (a GPU, a
    cluster, the network); a shown refusal refused with that message. What a reader brings
    is stood in for: their own data file (a few rows of its format), and the model an
    earlier documented command would have written (a tiny one)."""
    from tests.commands import all_commands

    commands = all_commands()
    assert len(commands) > 60
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    failures = []
    for c in commands:
        problem = _check(c, tmp_path, capsys)
        if problem:
            failures.append(f"{c.where}: {c.text}\n    {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "jobs" / "configs").glob("*.yaml")))
def test_every_recipe_config_dry_runs(name, tmp_path, monkeypatch, capsys, ray_never_starts):
    """Each jobs/configs file through the whole preflight as a reader would run it, on this
    machine: a hub model or a cluster's model directory stood in for by a tiny local model, a
    data file the reader brings by a few rows of its format, a cluster's shared paths and
    object storage by local folders."""
    from raylm import cli
    from raylm.config import load_config
    from raylm.hub import is_hub_id

    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = f"jobs/configs/{name}"
    cfg = load_config(config)
    overrides = ["--run.ray_address=local"]
    if cfg.run.storage_path.startswith(("s3://", "gs://", "/mnt/")):
        overrides += ["--run.storage_path=runs", "--run.cache_dir=cache"]
    if cfg.model.path and (is_hub_id(cfg.model.path) or not Path(cfg.model.path).exists()):
        # Small, but with the recipe's positions and weights that split into NF4's blocks.
        from transformers import AutoModelForCausalLM, LlamaConfig

        shape = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=max(4096, cfg.data.seq_len + 1))
        AutoModelForCausalLM.from_config(shape).save_pretrained(str(tmp_path / "model"))
        overrides.append(f"--model.path={tmp_path / 'model'}")
    sources = [cfg.data.source] if isinstance(cfg.data.source, str) else cfg.data.source
    if any(s != "builtin" and not s.startswith("hf:") and not Path(s).exists() for s in sources):
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _standin_rows(cfg.data.format)))
        overrides.append(f"--data.source={data}")
    code = cli.main(["train", "--config", config, *overrides, "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "raylm: dry run: the preflight passed" in captured.out


# A path of one machine: a checkout, a home directory (the Ray image's /home/ray is the
# image's own layout, which cluster/Dockerfile makes), pytest's or Ray's temporary folders.
MACHINE_PATH = re.compile(r"/work/main\b|/root/|/home/(?!ray/)[a-z_][\w-]*/|/tmp/pytest-|"
                          r"/tmp/ray/session_20\d\d|/Users/\w+/")


def test_no_committed_page_notebook_or_config_holds_a_machine_path():
    """Transcripts show paths relative to the checkout and ~ for the home directory
    (scripts/notebooks.py writes the notebooks' outputs so)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    found = []
    for name in listed:
        if not name.endswith((".md", ".ipynb", ".yaml", ".yml", ".py", ".sh", ".toml",
                              ".txt", ".json")) or name == "tests/unit/test_docs.py":
            continue
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_command_reference_shows_every_command_and_its_defaults():
    page = hooks().cli_reference()
    for command in ("config show", "prepare", "train", "tune", "submit", "jobs", "export",
                    "generate", "eval"):
        assert f"## raylm {command}\n" in page
    words = " ".join(page.split())
    assert "--dry-run" in words and "(default: 64)" in words
