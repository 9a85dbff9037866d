"""The package layout is the process layout, and it stays so: import-linter's contracts in
pyproject.toml (each layer imports only those below it, the data path imports no torch, no
import circles), functions short enough to read on one screen, and ruff's checks
(pyproject.toml's [tool.ruff]) clean."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100


def test_the_import_contracts_hold():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted((ROOT / "raylm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long)


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "raylm", "tests",
                           "jobs", "scripts"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# The budget docs/development.md states: raising one is a decision made there, with its reason.
MAX_LINES = 21_440  # raylm/ outside bench/
MAX_CONFIG_KEYS = 146


def test_the_codebase_keeps_its_budget(capsys):
    from raylm.config import Config

    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "raylm").rglob("*.py")
                if "bench" not in p.relative_to(ROOT / "raylm").parts)
    keys = len(Config().flat())
    longest = max(((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT / 'raylm')}:"
                    f"{node.name}")
                   for path in (ROOT / "raylm").rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))))
    with capsys.disabled():
        print(f"\nbudget: raylm/ outside bench/ {lines:,} lines of {MAX_LINES:,}; "
              f"{keys} config keys of {MAX_CONFIG_KEYS}; the longest function {longest[1]}, "
              f"{longest[0]} lines of {MAX_FUNCTION_LINES}")
    assert lines <= MAX_LINES, f"raylm/ outside bench/ has {lines:,} lines: over the budget"
    assert keys <= MAX_CONFIG_KEYS, f"{keys} config keys: over the budget"


def test_the_layout_table_names_every_module():
    """docs/development.md's layout table is where a newcomer finds the room for a change:
    every module of raylm/ (the benchmarks are listed by name) has its line there."""
    page = (ROOT / "docs" / "development.md").read_text()
    table = page[page.index("## Layout"):]
    table = table[table.index("```") + 3:]
    table = table[:table.index("```")]
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "raylm").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and "bench" not in p.parts
               and p.name not in table and f"{p.stem}:" not in table]
    assert missing == [], f"docs/development.md's layout table lacks {missing}"


def test_event_kinds_are_named_once():
    """A run's event kinds are raylm.contracts.Event's members: no module writes or compares one as
    a string of its own, so a kind cannot be renamed in one place and missed in another."""
    import re

    from raylm.contracts import Event

    kinds = "|".join(e.value for e in Event)
    literal = re.compile(rf'(["\']event["\']\]?\s*(?:==|!=|:|in\s*[(\[{{])\s*|_add\(|note\()'
                         rf'["\']({kinds})["\']')
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}"
             for p in sorted((ROOT / "raylm").rglob("*.py")) if "bench" not in p.parts
             for m in literal.finditer(p.read_text())]
    assert found == [], found


def test_no_module_of_raylm_is_named_as_its_api():
    """Importing ``raylm.X.y`` sets the attribute ``raylm.X`` to the module ``X``, which would
    hide the API's ``raylm.X`` (``raylm.export``, a function) for the rest of the process."""
    import raylm

    root = Path(raylm.__file__).parent
    modules = {p.stem for p in root.glob("*.py")} | {p.name for p in root.iterdir() if p.is_dir()}
    assert not modules & set(raylm.__all__)


def test_models_are_built_from_their_spec_outside_model():
    """Outside raylm/model, a model's transformers config comes from its ModelSpec, so every
    process builds the run's model from the same settings (raylm.model.spec)."""
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "raylm").rglob("*.py"))
             if "model" not in p.relative_to(ROOT / "raylm").parts[:1]
             and "build_config(" in p.read_text()]
    assert found == [], found


def test_the_driver_asks_the_objective_not_its_name():
    """raylm/run knows each train.objective through its object (raylm.run.objectives), so a new
    objective is one class there and one beside the workers' (raylm.workers.step.Objective),
    not a branch in every module that plans a run."""
    import re

    compared = re.compile(r"objective\s*(==|!=|in\b)|\.get\(cfg\.train\.objective")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}"
             for p in sorted((ROOT / "raylm" / "run").glob("*.py")) if p.name != "objectives.py"
             for m in compared.finditer(p.read_text())]
    assert found == [], found


def test_the_run_records_are_read_through_their_records():
    """What the controller, the driver and the later commands (raylm/run, raylm/after,
    raylm/formats, raylm/api.py) read of a worker's report, summary.json, run.json and
    events.jsonl, they read as raylm.contracts' records' fields, never by their names as
    strings (``m["tokens_per_s"]``, ``s.get("final_step")``, ``"val_loss" in r``): a renamed
    field is then a change every reader sees. Building a mapping for another API (MLflow's
    metric names, a DataFrame's columns, a Tune result) is not reading one; an objective's own
    figures (``rl_reward``) are read from the report's ``figures`` by name, by design."""
    from dataclasses import fields

    from raylm.contracts import RunInfo
    from raylm.contracts.events import GroupStart, Progress
    from raylm.contracts.report import Report
    from raylm.contracts.summary import Summary

    names = set().union(*({f.name for f in fields(r)} for r in (
        Report, Summary, RunInfo, GroupStart, Progress))) - {"figures"}
    # The same names in mappings that are not raylm's records, each with its reason.
    other = {("run/sweep.py", "step"): "Tune's metrics dataframe, by its time attribute",
             ("run/tracking.py", "step"): "the pruning report (raylm prune's own figures)"}
    files = [*(p for d in ("run", "after", "formats") for p in (ROOT / "raylm" / d).rglob("*.py")),
             ROOT / "raylm" / "api.py"]
    found = []
    for path in files:
        module = str(path.relative_to(ROOT / "raylm"))
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.slice, ast.Constant)):
                key = node.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("get", "pop") and node.args
                  and isinstance(node.args[0], ast.Constant)):
                key = node.args[0].value
            elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                  and isinstance(node.ops[0], (ast.In, ast.NotIn))):
                key = node.left.value
            if key in names and (module, key) not in other:
                found.append(f"{module}:{node.lineno} {key!r}")
    assert found == [], found
