"""The documentation site builds (strict: a broken link, anchor or page left out of the
navigation fails it), its configuration reference names every key of the config dataclasses,
and no page names a key that does not exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from raylm.config import Config

ROOT = Path(__file__).resolve().parents[2]
# Names that look like config keys and are not: a `raylm.Run`'s attributes (written `run.X`),
# the misspelled key the configuration page shows being refused, a model's modules, files.
NOT_KEYS = {"run.history", "run.summary", "run.checkpoint", "run.config", "run.mlflow_run_id",
            "train.stpes",
            # a Hugging Face decoder's modules
            "model.embed_tokens", "model.layers", "model.norm"}
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
