"""Fine-tuning examples: conversations and prompt/completion pairs, checked, then rendered to
token ids and a loss mask in one pass.

An example is rendered as a list of :class:`Segment` (a piece of text and whether its tokens
are trained); each segment is encoded on its own and the ids and mask are concatenated, so the
text the model sees and the mask cannot disagree, and generation renders its prompt the same
way (:func:`generation_prompt`).

Two renderers:

- :class:`DefaultTemplate`, for tokenizers without a chat template (raylm's own BPEs). It adds
  no tokens to the vocabulary: ``System: ...``, ``User: ...`` and ``Assistant:`` are plain
  text, and each assistant turn's content, after a space, is followed by the tokenizer's EOS,
  which is trained (that is how the model learns to stop). Turns are separated by a blank
  line. The space opens the answer's segment, so its first word is one token with its space,
  as in any client that writes ``Assistant: answer`` as one string (lm-eval's multiple choice
  among them). Version 1, of runs started before version 2 and of their exports, ended the
  header with it: a token of its own before the answer's.
- :class:`JinjaTemplate`, for a tokenizer with its own Jinja chat template (Llama 3, Qwen's
  ChatML, Gemma, Phi-3, Mistral ...), rendered by transformers' renderer. A template that
  marks what the assistant generates (``{% generation %}`` blocks) says itself what is trained.
  Otherwise the template is rendered for growing prefixes of the conversation; each message's
  segment is the text its prefix adds, and an assistant message's segment is split where the
  template's generation prompt (its assistant header) ends and again after the first
  end-of-turn token (an added token of the tokenizer: ``<|eot_id|>``, ``<|im_end|>``,
  ``<end_of_turn>``, ``<|end|>``, ``</s>``) that follows the content, so the model is trained
  on the content and the token that ends its turn, and not on the header or what the template
  writes after the turn (ChatML's and Gemma's newline). A template may close a conversation
  with text it writes only at the end (Phi-3 adds its EOS there): prefixes are compared
  without it. A template that does not render prefixes as prefixes of the whole otherwise
  cannot be split this way and is refused, by name.

With ``loss_on: all`` every segment is trained. A prompt given as a string, in any format
(prompt/completion, preference, prompt), is used as it is written: the prompt (untrained)
followed by the answer and EOS (trained), with no template, the plain-text fine-tuning
format; a prompt given as messages goes through the template (:func:`pair_segments`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}
LossOn = Literal["assistant", "all"]
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The longest text a template may write only after a conversation's last message.
CLOSING_CHARS = 64
DEFAULT_VERSION = 2  # of DefaultTemplate, for new runs


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
    eos: bool = False
    """Followed by the tokenizer's EOS token (trained with the segment)."""


class TemplateError(ValueError):
    """A chat template that cannot be rendered into trained and untrained pieces."""


# ---- Rendering -----------------------------------------------------------------------------


class DefaultTemplate:
    """Plain-text turns; no new tokens (see the module docstring for ``version``)."""

    def __init__(self, version: int = DEFAULT_VERSION) -> None:
        self.version, self.name = version, f"raylm default v{version}"
        # Where the space between the header and the answer goes.
        self.header, self.answer_prefix = ("Assistant: ", "") if version == 1 else (
            "Assistant:", " ")

    def segments(self, messages: Sequence[dict[str, str]]) -> list[Segment]:
        out = []
        for i, m in enumerate(messages):
            sep = "\n\n" if i else ""
            if m["role"] == "assistant":
                out.append(Segment(f"{sep}{self.header}", False))
                out.append(Segment(self.answer_prefix + m["content"], True, eos=True))
            else:
                out.append(Segment(f"{sep}{LABELS[m['role']]}: {m['content']}", False))
        return out

    def prompt(self, messages: Sequence[dict[str, str]]) -> list[Segment]:
        sep = "\n\n" if messages else ""
        return [*self.segments(messages), Segment(f"{sep}{self.header}", False)]

    @property
    def jinja(self) -> str:
        """This version as a Hugging Face chat template, which an export carries so that
        clients render what training rendered: the text of :meth:`segments` (the EOS
        written as its token), and with ``add_generation_prompt`` that of :meth:`prompt`."""
        return (DEFAULT_JINJA.replace("ANSWER", json.dumps(self.header + self.answer_prefix))
                .replace("HEADER", json.dumps(self.header)))


# DefaultTemplate as Jinja; ANSWER and HEADER are its version's (tests/unit/data/test_chat.py
# renders both versions against the segments).
DEFAULT_JINJA = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ ANSWER + message['content'] + eos_token }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] }}"
    "{%- elif message['role'] == 'system' -%}{{ 'System: ' + message['content'] }}"
    "{%- else -%}{{ raise_exception('raylm\\'s default template takes system, user and "
    "assistant turns') }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if messages -%}{{ '\\n\\n' }}{%- endif -%}"
    "{{ HEADER }}{%- endif -%}")


class JinjaTemplate:
    """A Hugging Face chat template (the Jinja source a tokenizer carries), rendered with
    transformers' own renderer and the tokenizer's special-token strings (see the module
    docstring). Built from strings, so it travels to Ray Data tasks without the tokenizer."""

    def __init__(self, source: str, special_tokens: dict[str, Any] | None = None, *,
                 name: str = "the tokenizer's chat template",
                 markers: Sequence[str] = ()) -> None:
        self.source, self.special_tokens, self.name = source, dict(special_tokens or {}), name
        # The tokenizer's added tokens, where an assistant turn's trained text ends.
        self.markers = tuple(m for m in markers if m)
        self.marks_generation = bool(GENERATION_BLOCK.search(source))

    def _render(self, messages: Sequence[dict[str, str]], *, generation: bool) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        if not messages and not generation:
            return ""
        rendered, _ = render_jinja_template(
            conversations=[list(messages)], chat_template=self.source,
            add_generation_prompt=generation, **self.special_tokens)
        return rendered[0]

    def _piece(self, longer: str, shorter: str, at: int) -> str:
        if not longer.startswith(shorter):
            raise TemplateError(
                f"{self.name} does not render message {at + 1} of a conversation as a "
                f"continuation of the messages before it, so raylm cannot tell which tokens "
                f"to train; set data.loss_on=all, or give a tokenizer whose template renders "
                f"prefixes as prefixes (most do).")
        return longer[len(shorter):]

    def _end_of_turn(self, piece: str, content: str) -> int:
        """Where the trained part of an assistant ``piece`` ends: after the first marker that
        follows ``content`` (the whole piece when none does)."""
        at = piece.find(content.strip()) if content.strip() else -1
        start = at + len(content.strip()) if at >= 0 else 0
        found = [(i, -len(m)) for m in self.markers if (i := piece.find(m, start)) >= 0]
        if not found:
            return len(piece)
        i, neg = min(found)
        return i - neg

    def _generation_segments(self, messages: Sequence[dict[str, str]]) -> list[Segment]:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, spans = render_jinja_template(
            conversations=[list(messages)], chat_template=self.source,
            return_assistant_tokens_mask=True, **self.special_tokens)
        text, out, at = rendered[0], [], 0
        for start, end in spans[0]:
            out += [Segment(text[at:start], False), Segment(text[start:end], True)]
            at = end
        return [s for s in [*out, Segment(text[at:], False)] if s.text]

    def _open(self, prefix: str, whole: str) -> str:
        """``prefix`` (a rendering of the first messages) without what a template writes only
        where a conversation ends (Phi-3's EOS after the last turn), so that it is the start of
        ``whole``; as it is when no such ending makes it one. They part where they first
        differ, moved back to the start of a marker that place cuts (``<|end...`` and
        ``<|user...`` share their first characters)."""
        if whole.startswith(prefix):
            return prefix
        cut = len(os.path.commonprefix([prefix, whole]))
        for m in self.markers:
            at = prefix.rfind(m, max(0, cut - len(m) + 1), cut + len(m))
            if 0 <= at < cut < at + len(m):
                cut = at
        closing = prefix[cut:]
        return prefix[:cut] if len(closing) <= CLOSING_CHARS and whole.endswith(closing) \
            else prefix

    def segments(self, messages: Sequence[dict[str, str]]) -> list[Segment]:
        if self.marks_generation:
            return self._generation_segments(messages)
        whole = self._render(messages, generation=False)
        out, done = [], ""
        for k, m in enumerate(messages):
            full = self._open(self._render(messages[:k + 1], generation=False), whole)
            if m["role"] == "assistant":
                head = self._render(messages[:k], generation=True)
                out.append(Segment(self._piece(head, done, k), False))
                turn = self._piece(full, head, k)
                cut = self._end_of_turn(turn, m["content"])
                out += [Segment(turn[:cut], True), Segment(turn[cut:], False)]
            else:
                out.append(Segment(self._piece(full, done, k), False))
            done = full
        return [s for s in out if s.text]

    def prompt(self, messages: Sequence[dict[str, str]]) -> list[Segment]:
        return [Segment(self._render(messages, generation=True), False)]


DEFAULT_JINJAS = frozenset(DefaultTemplate(v).jinja for v in (1, 2))


def template_args(hf_tokenizer) -> dict[str, Any] | None:
    """What :class:`JinjaTemplate` takes from a Hugging Face tokenizer, as plain strings (they
    travel to Ray Data tasks); None when it has no chat template of its own (raylm's trained
    BPEs, and exports of runs trained with raylm's default)."""
    source = getattr(hf_tokenizer, "chat_template", None) if hf_tokenizer is not None else None
    # raylm's default as an export carries it is raylm's default: rendered as before, by
    # segments, in the version the run that reads it records.
    if not source or not isinstance(source, str) or source in DEFAULT_JINJAS:
        return None
    # Only special tokens mark turns; an added ordinary word must not move a cut.
    added = [t.content for t in getattr(hf_tokenizer, "added_tokens_decoder", {}).values()
             if t.special]
    return {"source": source, "special_tokens": dict(hf_tokenizer.special_tokens_map),
            "name": f"the chat template of {hf_tokenizer.name_or_path}",
            "markers": sorted(set(added) | {hf_tokenizer.eos_token or ""})}


def template_for(hf_tokenizer, version: int = DEFAULT_VERSION) -> DefaultTemplate | JinjaTemplate:
    """The tokenizer's own chat template when it has one, else raylm's default."""
    args = template_args(hf_tokenizer)
    return JinjaTemplate(**args) if args else DefaultTemplate(version)


def conversation_segments(template: DefaultTemplate | JinjaTemplate,
                          messages: Sequence[dict[str, str]], *, loss_on: LossOn
                          ) -> list[Segment]:
    """A conversation's segments; with ``loss_on: all`` a tokenizer's template is rendered
    whole (nothing needs splitting, so any template works)."""
    if loss_on == "all" and isinstance(template, JinjaTemplate):
        return [Segment(template._render(messages, generation=False), True)]
    return template.segments(messages)


def answer_segments(template: DefaultTemplate | JinjaTemplate,
                    prompt: Sequence[dict[str, str]], answer: Sequence[dict[str, str]]
                    ) -> list[Segment]:
    """A preference pair's half: the prompt and one answer rendered as one conversation, with
    only the answer's turns trained (assistant turns inside the prompt are context)."""
    segments = template.segments([*prompt, *answer])
    trained = [i for i, s in enumerate(segments) if s.trained]
    keep = set(trained[len(trained) - len(answer):])
    return [s if i in keep or not s.trained else Segment(s.text, False, s.eos)
            for i, s in enumerate(segments)]


def pair_segments(template: DefaultTemplate | JinjaTemplate, prompt: str | Sequence[dict[str, str]],
                  answer: str | Sequence[dict[str, str]]) -> list[Segment]:
    """A prompt and its answer as training renders them, by one rule for every format: a
    string prompt as it is written, then its answer (a string) and EOS, with no template
    (the plain-text fine-tuning format); a conversation through the template, only the
    answer's turns trained (:func:`answer_segments`)."""
    if isinstance(prompt, str):
        return [Segment(prompt, False), Segment(answer, True, eos=True)]
    return answer_segments(template, prompt, answer)


def prompt_segments(template: DefaultTemplate | JinjaTemplate,
                    prompt: str | Sequence[dict[str, str]]) -> list[Segment]:
    """What a model is given to answer ``prompt``: a string as it is written, a conversation as
    the template's generation prompt."""
    return [Segment(prompt, False)] if isinstance(prompt, str) else template.prompt(prompt)


def example_pair(example: list | dict) -> tuple[Any, Any]:
    """A prepared prompt/completion example (:func:`raylm.data.corpus.parse_prompt_completion`)
    as its prompt and answer: two strings (kept as two messages) or message lists."""
    if isinstance(example, dict):
        return example["prompt"], example["completion"]
    user, assistant = example
    return user["content"], assistant["content"]


def example_text(value: str | list | dict) -> str:
    """A prepared example as raylm's default template renders it, what a tokenizer trained on
    the examples learns from: a conversation; a string prompt as written; a prompt and each of
    its answers (a pair's halves)."""
    template = DefaultTemplate()
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(s.text for s in template.segments(value))
    return "".join(s.text for name, answer in value.items() if name != "prompt"
                   for s in pair_segments(template, value["prompt"], answer))


def turns(value: str | list | dict) -> list[dict[str, str]]:
    """Every message of a prepared example (a string, a conversation or a dict of them), a
    string standing as one user message: what the control-token and length checks read."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict):
        return [m for part in value.values() for m in turns(part)]
    return list(value)


# ---- Encoding ------------------------------------------------------------------------------


def encode(segments: Sequence[Segment], tokenizer, *, eos_id: int, loss_on: LossOn
           ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the loss mask (1: the token is a trained target) of ``segments``, each
    encoded with ``tokenizer`` (a ``tokenizers.Tokenizer``) on its own."""
    encoded = tokenizer.encode_batch([s.text for s in segments], add_special_tokens=False)
    ids: list[int] = []
    mask: list[int] = []
    for seg, enc in zip(segments, encoded, strict=True):
        trained = 1 if seg.trained or loss_on == "all" else 0
        ids.extend(enc.ids)
        mask.extend([trained] * len(enc.ids))
        if seg.eos:
            ids.append(eos_id)
            mask.append(trained)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def control_text(tokenizer) -> re.Pattern | None:
    """What in a message's text would become a control token if tokenized as it is: the
    tokenizer's special tokens (end of text, turn markers), as one pattern; None when it has
    none. ``tokenizer``: a ``tokenizers.Tokenizer``."""
    specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()
                       if t.special and t.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def forged(messages: Sequence[dict[str, str]], pattern: re.Pattern | None) -> str | None:
    """The first control token a message's text spells out (``pattern``: :func:`control_text`),
    or None. Such text would end a document or forge a turn where the template renders it."""
    if pattern is None:
        return None
    for m in messages:
        found = pattern.search(m["content"])
        if found:
            return found.group(0)
    return None


def longest_token_chars(tokenizer) -> int | None:
    """The most characters of text one token of ``tokenizer`` (a ``tokenizers.Tokenizer``)
    stands for, or None when its normalizer may delete characters (then no number of
    characters bounds the number of tokens from below). A vocabulary entry is written one
    character per byte (byte-level BPE) or per character (SentencePiece), so its length bounds
    the text it covers."""
    normalizer = json.loads(tokenizer.to_str()).get("normalizer")
    if not _keeps_characters(normalizer):
        return None
    return max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))


def _keeps_characters(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(n) for n in normalizer["normalizers"])
    if kind == "Replace":
        return bool(normalizer.get("content"))
    return kind in ("NFC", "NFKC", "Prepend")


def within_chars(messages: list[dict[str, str]], max_chars: int
                 ) -> tuple[list[dict[str, str]], bool]:
    """``messages`` cut so that their contents hold at most ``max_chars`` characters (the
    message that crosses the limit shortened, those after it left out), and whether anything
    was cut. With ``max_chars`` at least twice a block's tokens times
    :func:`longest_token_chars`, what is cut lies past the block's end, so rendering the cut
    conversation gives the block the whole one would, at a cost bounded by the block rather
    than by the record."""
    kept, left = [], max_chars
    for m in messages:
        if len(m["content"]) > left:
            if left:
                kept.append({**m, "content": m["content"][:left]})
            return kept, True
        kept.append(m)
        left -= len(m["content"])
    return kept, False


def generation_prompt(messages: Sequence[dict[str, str]], tokenizer, template, *,
                      eos_id: int) -> np.ndarray:
    """The ids a model is given to answer ``messages`` (which end with a user turn), rendered
    as training rendered them. A message that spells out a control token is refused: it
    would inject a turn or a role."""
    token = forged(messages, control_text(tokenizer))
    if token is not None:
        raise ValueError(f"a chat message holds the text {token!r}, the tokenizer's control "
                         f"token: rendered, it would end the turn or start another; remove it "
                         f"(a plain prompt keeps it as ordinary text).")
    ids, _ = encode(template.prompt(messages), tokenizer, eos_id=eos_id, loss_on="all")
    return ids
