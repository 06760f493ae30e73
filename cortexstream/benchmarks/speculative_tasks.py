"""The task families of `bench speculative`, as chat messages built from text already on this machine.

- edit: a real Python function (the standard library's own source, through `inspect.getsource`) and a request to
  rename one of its parameters or add one, returning the whole function: the answer mostly copies its input.
- summarize: a Wikipedia passage (gensim's test data, read only when it is already cached locally) to summarise.
- quote: a Wikipedia passage and a request to quote the sentence containing a given phrase, word for word.
- chat: an open-ended question with nothing to copy from (prompt lookup has little to find).

Each family has `MAX_INPUTS` different inputs, so a batch of up to that many requests never repeats a prompt.
Nothing here downloads: without the cached Wikipedia text the passages come from the Python docs (`pydoc_data`)
and the results say so.
"""

from __future__ import annotations

import ast
import glob
import importlib
import inspect
import itertools
import os
import re
import textwrap
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

MAX_INPUTS = 8
PASSAGE_WORDS = (180, 320)  # a passage: whole paragraphs from this many words on, cut to at most the second

# Real functions of 50-80 lines, stable across CPython 3.10-3.13 (module, qualified name).
EDIT_FUNCTIONS = (
    ("shutil", "_copytree"), ("heapq", "merge"), ("json.decoder", "JSONObject"), ("difflib", "unified_diff"),
    ("statistics", "median_grouped"), ("heapq", "nsmallest"), ("urllib.parse", "urlsplit"),
    ("fractions", "Fraction.limit_denominator"),
)

CHAT_QUESTIONS = (
    "What are some good habits for someone learning to play the piano as an adult?",
    "Why do people enjoy watching sports they have never played themselves?",
    "Give me a few ideas for a relaxing weekend in a small town.",
    "How would you explain to a child why the sky is blue?",
    "What makes a story memorable long after you have read it?",
    "Suggest some ways to stay focused while working from home.",
    "What should I think about before adopting a dog?",
    "Why do you think board games are still popular today?",
)


class Task(str, Enum):
    EDIT = "edit"
    SUMMARIZE = "summarize"
    QUOTE = "quote"
    CHAT = "chat"

    @property
    def grounded(self) -> bool:
        """Whether the answer is expected to copy from the prompt (the issue's input-grounded tasks)."""
        return self is not Task.CHAT


@dataclass(frozen=True)
class TaskPrompt:
    """One request: `messages` for the chat template; `source` the text it is grounded in ("" for chat);
    `expected` the sentence a quote task asks for ("" otherwise)."""

    task: Task
    messages: tuple[dict[str, str], ...]
    source: str = ""
    expected: str = ""
    origin: str = ""


def function_source(module: str, qualname: str) -> str:
    """The source of a standard-library function or method, dedented."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return textwrap.dedent(inspect.getsource(obj))


def _renamable_parameter(source: str) -> str | None:
    """The function's first parameter with a name of 3+ letters (not self/cls), or None."""
    function = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    a = function.args
    names = [p.arg for p in [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs]]
    return next((n for n in names if len(n) >= 3 and n not in ("self", "cls")), None)


def edit_prompts(count: int) -> list[TaskPrompt]:
    prompts = []
    for i, (module, qualname) in enumerate(EDIT_FUNCTIONS[:count]):
        source = function_source(module, qualname)
        name = qualname.rsplit(".", 1)[-1]
        parameter = _renamable_parameter(source)
        if i % 2 == 0 and parameter is not None:
            ask = (f"Rename the parameter `{parameter}` of `{name}` to `{parameter}_value` everywhere in the "
                   "function (signature, body and docstring).")
        else:
            ask = (f"Add a keyword-only parameter `verbose: bool = False` to `{name}`; when it is true, print "
                   "the function's name when it starts.")
        content = (f"Here is a Python function:\n\n```python\n{source}```\n\n{ask} Return the whole function in "
                   "one Python code block.")
        prompts.append(TaskPrompt(Task.EDIT, ({"role": "user", "content": content},), source,
                                  origin=f"{module}.{qualname}"))
    return prompts


def article_passages(text: str) -> Iterator[str]:
    """The passage of every article (blank-line separated) of `text` long enough to give one: its paragraphs from
    the first on, until PASSAGE_WORDS[0] words, cut at PASSAGE_WORDS[1]."""
    low, high = PASSAGE_WORDS
    for article in text.split("\n\n"):
        words = 0
        kept: list[str] = []
        for paragraph in article.split("\n"):
            if words >= low:
                break
            n = len(paragraph.split())
            if words + n > high:
                paragraph = " ".join(paragraph.split()[: high - words])
                n = high - words
            kept.append(paragraph)
            words += n
        if words >= low:
            yield "\n".join(kept)


def passages(text: str, count: int, skip: int = 0) -> list[str]:
    """`count` passages of different articles of `text`, after the first `skip` (`article_passages`)."""
    found = list(itertools.islice(article_passages(text), skip, skip + count))
    if len(found) < count:
        raise ValueError(f"the text has {skip + len(found)} articles of {PASSAGE_WORDS[0]}+ words; "
                         f"{skip + count} are needed")
    return found


def summarize_prompts(text: str, count: int) -> list[TaskPrompt]:
    return [TaskPrompt(Task.SUMMARIZE, ({"role": "user", "content": f"Summarise this passage in a few sentences."
                                                                     f"\n\n{p}"},), p)
            for p in passages(text, count)]


def sentences(passage: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", passage) if s.strip()]


def quote_prompts(text: str, count: int) -> list[TaskPrompt]:
    """Passages from other articles than `summarize_prompts`; each asks for one of its middle sentences, named by
    four of its words in a row that occur nowhere else in the passage."""
    prompts = []
    for passage in itertools.islice(article_passages(text), MAX_INPUTS, None):
        if len(prompts) == count:
            break
        middle = sentences(passage)[1:-1]
        middle.sort(key=lambda s: abs(len(s.split()) - 25))  # a sentence of about 25 words if there is one
        for sentence in middle:
            words = sentence.split()
            if len(words) < 10:
                continue
            phrase = " ".join(words[len(words) // 2 - 2: len(words) // 2 + 2])
            if passage.count(phrase) == 1:
                ask = (f"Quote, word for word, the sentence of the document above that contains the words "
                       f"\"{phrase}\". Answer with the quotation only.")
                prompts.append(TaskPrompt(Task.QUOTE, ({"role": "user", "content": f"Document:\n\n{passage}\n\n"
                                                                                  f"{ask}"},), passage, sentence))
                break
    if len(prompts) < count:
        raise ValueError(f"the text gives {len(prompts)} quote prompts; {count} are needed")
    return prompts


def chat_prompts(count: int) -> list[TaskPrompt]:
    return [TaskPrompt(Task.CHAT, ({"role": "user", "content": q},)) for q in CHAT_QUESTIONS[:count]]


def build_prompts(task: Task, count: int, wiki: str) -> list[TaskPrompt]:
    """`count` (at most MAX_INPUTS) different prompts of `task`; `wiki` is the text passages are cut from."""
    if not 1 <= count <= MAX_INPUTS:
        raise ValueError(f"count: {count} must be in 1..{MAX_INPUTS}")
    if task is Task.EDIT:
        return edit_prompts(count)
    if task is Task.SUMMARIZE:
        return summarize_prompts(wiki, count)
    if task is Task.QUOTE:
        return quote_prompts(wiki, count)
    return chat_prompts(count)


def local_wiki_text() -> tuple[str, str]:
    """The Wikipedia text of `evaluation.wiki_corpus` when it (or the gensim wheel it comes from) is already on
    this machine, else the Python docs' topics; never a download. (text, what it is)."""
    from cortexstream.evaluation.wiki_corpus import CACHE_DIR, GENSIM_VERSION, wiki_text

    cached = os.path.exists(os.path.join(CACHE_DIR, "enwiki-gensim.txt"))
    if cached or glob.glob(os.path.join(CACHE_DIR, f"gensim-{GENSIM_VERSION}-*.whl")):
        return wiki_text()
    from pydoc_data.topics import topics

    text = "\n\n".join(re.sub(r"\n\s*\n", "\n", topics[k]) for k in sorted(topics))  # one topic, one article
    return text, "pydoc_data topics (the gensim Wikipedia text is not on this machine)"


def prompt_tokens(tokenizer: Any, prompt: TaskPrompt) -> list[int]:
    """The request's token ids through the model's chat template (what both systems are given)."""
    from cortexstream.engine.prompt import chat_tokens

    return chat_tokens(tokenizer, list(prompt.messages))


__all__ = ["CHAT_QUESTIONS", "EDIT_FUNCTIONS", "MAX_INPUTS", "Task", "TaskPrompt", "article_passages",
           "build_prompts", "chat_prompts", "edit_prompts", "function_source", "local_wiki_text", "passages",
           "prompt_tokens", "quote_prompts", "sentences", "summarize_prompts"]
