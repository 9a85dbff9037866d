"""The commands the documentation shows, read the way a reader copies them: every line of a
fenced shell block (``bash``, ``sh``, ``console``, or a plain block's ``$ `` lines) in
README.md and docs/*.md, every command in a jobs/configs/*.yaml header, and every inline code
span that is a whole ``raylm`` or ``python -m raylm...`` command.

A command that needs what a test machine lacks says so in a comment on its own line, visible
to the reader: ``# needs a GPU``, ``# needs a cluster``, ``# needs the network`` (several may
be joined with "and"). A transcript (``$ raylm ...`` followed by ``raylm: error: ...``) shows
a refusal: the refusal is what it promises.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS = re.compile(r"#.*?\bneeds ((?:a GPU|a cluster|the network)"
                   r"(?:(?:,| and) (?:a GPU|a cluster|the network))*)")
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.M | re.S)
_COMMAND = re.compile(r"^(?:raylm |python3? -m raylm[\w.]* |python3? jobs/\w+\.py)")
# A usage line in prose, not a command: a placeholder (ID, RUN_DIR, OUT.json), an optional
# part ([--follow]) or a choice (list|status).
_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]{1,}\b|[\[|]|\.\.\.")


@dataclass
class Command:
    where: str
    """``page:line``."""
    argv: list[str]
    """The words of the command, its leading VAR=value assignments left out."""
    env: dict[str, str] = field(default_factory=dict)
    needs: frozenset[str] = frozenset()
    """What it needs beyond this machine: "a GPU", "a cluster", "the network"."""
    refusal: str | None = None
    """A transcript's promised error line, without its ``raylm: error: `` and any "..."."""
    inline: bool = False
    """Written in prose (an inline code span): parsed, never run."""

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def _needs(comment: str) -> frozenset[str]:
    m = NEEDS.search(comment)
    if not m:
        return frozenset()
    return frozenset(p.strip() for p in re.split(r",| and ", m.group(1)) if p.strip())


def _split(line: str) -> tuple[str, str]:
    """(the command, its trailing comment)."""
    # A "#" that starts a word outside quotes starts the comment.
    quote, i = None, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:]
        i += 1
    return line.rstrip(), ""


def _commands_of(line: str, *, where: str, comment: str = "") -> list[Command]:
    """The raylm commands of one shell line (``a && b`` gives two)."""
    body, trailing = _split(line)
    needs = _needs(trailing or comment)
    out = []
    for part in re.split(r"\s*(?:&&|;)\s*", body):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if "--" in words and words[:3] == ["ray", "job", "submit"]:
            words = words[words.index("--") + 1:]
        if words and _COMMAND.match(" ".join(words)):
            out.append(Command(where=where, argv=words, env=env, needs=needs))
    return out


def page_commands(page: Path) -> list[Command]:
    """Every command of a Markdown page, in the order it shows them."""
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    found: list[tuple[int, Command]] = []
    for block in _FENCE.finditer(text):
        lang = block.group(1).strip()
        first = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).splitlines()
        if lang not in SHELL_BLOCKS and lang:
            continue
        transcript = lang in ("console", "") or any(s.startswith("$ ") for s in lines)
        i = 0
        while i < len(lines):
            line, number = lines[i], first + i
            if transcript:
                if not line.startswith("$ "):
                    i += 1
                    continue
                line = line[2:]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            commands = _commands_of(line, where=f"{name}:{number}")
            if transcript and commands and i < len(lines) and \
                    lines[i].startswith("raylm: error: "):
                commands[-1].refusal = lines[i].removeprefix("raylm: error: ").split("...")[0]
            found.extend((number, c) for c in commands)
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"`([^`]+)`", prose):
        words = " ".join(span.group(1).split())
        if _COMMAND.match(words) and len(words.split()) > 3 and not _PLACEHOLDER.search(
                re.sub(r"--[\w.-]+|=\S*", "", words)):
            number = prose.count("\n", 0, span.start()) + 1
            for c in _commands_of(words, where=f"{name}:{number}"):
                c.inline = True
                found.append((number, c))
    return [c for _, c in sorted(found, key=lambda pair: pair[0])]


def yaml_header_commands(config: Path) -> list[Command]:
    """The commands a jobs/configs file's header comment shows (``#   raylm ...``)."""
    name = config.relative_to(ROOT).as_posix()
    lines = config.read_text().splitlines()
    out, i = [], 0
    while i < len(lines) and lines[i].startswith("#"):
        line, number = lines[i][1:], i + 1
        i += 1
        if not line.startswith("   "):  # prose; a command is indented
            continue
        line = line.strip()
        while line.endswith("\\") and i < len(lines) and lines[i].startswith("#"):
            line = line[:-1].rstrip() + " " + lines[i][1:].strip()
            i += 1
        out.extend(_commands_of(line, where=f"{name}:{number}"))
    return out


def documented_pages() -> list[Path]:
    """README.md, then the docs in the order of the site's navigation."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out.extend(files(value) if isinstance(value, list) else [value])
        return out

    ordered = [ROOT / "docs" / f for f in files(nav) if f.endswith(".md")]
    rest = sorted(set((ROOT / "docs").glob("*.md")) - set(ordered))
    return [ROOT / "README.md", *ordered, *rest]


def all_commands() -> list[Command]:
    out = [c for page in documented_pages() for c in page_commands(page)]
    for config in sorted((ROOT / "jobs" / "configs").glob("*.yaml")):
        out.extend(yaml_header_commands(config))
    return out
