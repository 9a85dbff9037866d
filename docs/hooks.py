"""MkDocs hooks: the home page is the README (its links made relative to this folder), and
the configuration reference is written from the config dataclasses at every build, so it
cannot fall behind them (tests/unit/test_docs.py checks that it names every key and that no
page names a key that does not exist)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def on_page_markdown(markdown: str, page, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        return home()
    if page.file.src_uri == "cli-reference.md":
        return markdown.replace("<!-- generated -->", cli_reference())
    if page.file.src_uri == "changelog.md":
        return (ROOT / "CHANGELOG.md").read_text()
    if page.file.src_uri == "configuration-reference.md":
        return markdown.replace("<!-- generated -->", reference())
    return markdown


def home() -> str:
    """README.md with its links into docs/ made relative to docs/, and its links to the
    repository's own files (LICENSE) left as their names: the site holds no copy of them."""
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    text = text.replace("](CHANGELOG.md)", "](changelog.md)")
    return re.sub(r"\[([^\]]+)\]\((LICENSE)\)", r"\1 (the \2 file)", text)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (a string literal right after
    the field's line), by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "unset"
    return f"`{json.dumps(value) if isinstance(value, (list, dict, bool)) else value}`"


def _type(annotation: str) -> str:
    return f"`{annotation}`".replace("|", "\\|")


def sections() -> list[tuple[str, type]]:
    from raylm.config import Config

    # Each section is a field of Config whose default is an instance of the section's class.
    return [(f.name, type(f.default_factory())) for f in dataclasses.fields(Config)]


def reference() -> str:
    """Every section and key of the configuration: type, default and what it does."""
    out = []
    for section, cls in sections():
        out.append(f"## {section}\n")
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out.append(inspect.cleandoc(cls.__doc__) + "\n")
        docs = field_docs(cls)
        out.append("| key | type | default | what it does |\n|---|---|---|---|")
        for f in dataclasses.fields(cls):
            # Lines joined: a word hyphenated across a line break is one word again.
            doc = re.sub(r"-\n(?=[a-z])", "-", docs.get(f.name, ""))
            doc = " ".join(doc.split()).replace("|", "\\|")
            out.append(f"| `{section}.{f.name}` | {_type(str(f.type))} | {_default(f)} | {doc} |")
        out.append("")
    return "\n".join(out)


def cli_reference() -> str:
    """Every ``raylm`` command's help, as ``raylm COMMAND --help`` prints it."""
    import argparse
    import os

    from raylm.cli import _parser

    out = []

    def add(parser: argparse.ArgumentParser, name: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if name:
            out.append(f"## raylm {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        for sub in subs:
            for child, child_parser in sub.choices.items():
                add(child_parser, f"{name} {child}".strip())

    # argparse wraps to the terminal's width; the page's is fixed.
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        root = _parser()
        out.append(f"```text\n{root.format_help().rstrip()}\n```\n")
        add(root, "")
    finally:
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(out)
