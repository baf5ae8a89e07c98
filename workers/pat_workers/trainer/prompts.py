"""The prompts as the generators receive them: each problem rendered with the tokenizer's chat template
(dataset.chatTemplate) or as its raw text, and its token ids. The trainer sends these ids; `pat data` prints them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pat_operator.api import Dataset
from tokenizers import Tokenizer

from ..engine.loader import load_tokenizer
from .data import Problem

# Where a Hugging Face model directory keeps its chat template (transformers >= 4.50 writes chat_template.jinja);
# without either, transformers is not needed (the tiny model's tokenizer.json alone).
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Rendered:
    text: str  # what the token ids spell, special tokens written out (<|im_start|>)
    token_ids: list[int]


class Prompts:
    """render(i): problem i as the generators receive it. With a chat template (`chat`, a transformers tokenizer):
    the template's text, tokenized without adding special tokens, since the template writes them (BOS too); a
    text prompt becomes one user message. Without: the raw text, tokenized with what the tokenizer adds (BOS)."""

    def __init__(self, problems: Sequence[Problem], tokenizer: Tokenizer, chat: Any = None):
        self.problems, self.tokenizer, self.chat = problems, tokenizer, chat

    def __len__(self) -> int:
        return len(self.problems)

    def render(self, index: int) -> Rendered:
        prompt = self.problems[index].prompt
        if self.chat is None:  # load_prompts refused chat messages without a template
            ids = self.tokenizer.encode(prompt).ids
            return Rendered(self.tokenizer.decode(ids, skip_special_tokens=False), ids)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return Rendered(text, self.chat.encode(text, add_special_tokens=False))


def load_prompts(problems: Sequence[Problem], tokenizer_dir: str | Path, spec: Dataset) -> Prompts:
    """The Prompts of `problems` with the tokenizer in tokenizer_dir, its chat template as dataset.chatTemplate says;
    refuses what would not render as meant."""
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    chat = None if spec.chat_template is False else chat_tokenizer(tokenizer_dir)
    if chat is None:
        why = ("dataset.chatTemplate is false" if spec.chat_template is False
               else f"the tokenizer in {tokenizer_dir} has no chat template")
        if spec.chat_template:
            raise ValueError(f"dataset.chatTemplate is true but {why} (tokenizer_config.json's chat_template, or "
                             "chat_template.jinja); set dataset.chatTemplate: false to send the raw text, or use "
                             "an instruct model's tokenizer")
        if (index := next((i for i, p in enumerate(problems) if not isinstance(p.prompt, str)), None)) is not None:
            raise ValueError(f"problem {index}: dataset.promptField={spec.prompt_field!r} holds chat messages, "
                             f"which need a chat template, but {why}; use a tokenizer with a chat template "
                             "(dataset.chatTemplate unset or true), or a field of text prompts")
        return Prompts(problems, tokenizer)
    if written := [t.content for t in tokenizer.get_added_tokens_decoder().values()
                   if t.special and t.content in spec.prompt_template]:
        raise ValueError(f"dataset.promptTemplate writes the chat format itself ({', '.join(written)}), and the "
                         f"tokenizer's chat template would wrap it again: leave the chat format out of "
                         "dataset.promptTemplate (keep the instruction), or set dataset.chatTemplate: false")
    prompts = Prompts(problems, tokenizer, chat)
    prompts.render(0)  # a template that refuses these messages (role order, a system turn) fails here, at start
    return prompts


def chat_tokenizer(tokenizer_dir: Path) -> Any:
    """transformers' tokenizer of tokenizer_dir if it has a chat template, else None."""
    if not any((tokenizer_dir / name).is_file() for name in TEMPLATE_FILES):
        return None
    from transformers import AutoTokenizer  # only chat templates need it

    chat = AutoTokenizer.from_pretrained(tokenizer_dir)
    return chat if chat.chat_template else None
