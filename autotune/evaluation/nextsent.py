"""The built-in multiple-choice task `builtin:pydoc-nextsent`: pick the true next sentence among four.

Built from `builtin:pydoc-heldout` (topics kept out of tiny-moe's training), deterministically for a given Python:
prose paragraphs (code blocks and grammar left out) are cut into sentences. An item's context is up to
CONTEXT_SENTENCES sentences and the first half of the next sentence's words (the cue, as HellaSwag gives the start
of the event); the answer is the rest of that sentence, and the three distractors are the rest of sentences of
other topics of the same text, the closest in length to the answer (so that plain log-likelihood accuracy does not
favour the shortest choice), ties broken by a seeded shuffle. The answer's position is seeded too. Without the
cue, tiny-moe chose the true next sentence at chance (26.9 % of 487 items), too weak a model for a task that says
nothing about it; with the cue it is well above chance.
lm-evaluation-harness reads it as a local task: a JSONL file and a task YAML (`dataset_path: json`).
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from autotune.calibration.texts import pydoc_documents
from runtime.fileio import atomic_write_bytes

NAME = "builtin:pydoc-nextsent"
TASK = "npumoe_pydoc_nextsent"  # the name lm-eval knows it by
CONTEXT_SENTENCES = 2
CHOICES = 4
MIN_CHARS, MAX_CHARS = 30, 240
MIN_WORDS = 6  # a sentence split in half keeps at least three words of cue and three to choose
SEED = 13
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_PROSE = re.compile(r"^[A-Z\"'(][^\n]*$")

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _sentences(paragraph: str) -> list[str]:
    """Sentences of a prose paragraph; an indented or symbol-led paragraph (code, grammar, tables) has none."""
    if paragraph.startswith((" ", "\t")) or "::=" in paragraph or ">>>" in paragraph:
        return []
    flat = " ".join(paragraph.split())
    return [s for s in _SENTENCE_END.split(flat) if _PROSE.match(s)]


def _usable(sentence: str) -> bool:
    return (MIN_CHARS <= len(sentence) <= MAX_CHARS and sentence[-1] in ".!?"
            and len(sentence.split()) >= MIN_WORDS)


def _split(sentence: str) -> tuple[str, str]:
    """(cue, rest): the first half of the words, and the rest."""
    words = sentence.split()
    k = len(words) // 2
    return " ".join(words[:k]), " ".join(words[k:])


def _runs(document: str) -> list[list[str]]:
    """Sentences of each run of consecutive prose paragraphs (a code block or grammar ends a run)."""
    runs: list[list[str]] = [[]]
    for paragraph in document.split("\n\n"):
        sentences = _sentences(paragraph)
        if sentences:
            runs[-1] += sentences
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if len(r) > 1]


def items() -> list[dict]:
    """The task's items: {context, choices, label}, in text order."""
    docs = [_runs(d) for d in pydoc_documents(heldout=True)]
    first_doc: dict[str, int] = {}  # topics quote each other: a rest belongs to the first topic that has it
    for di, doc in enumerate(docs):
        for run in doc:
            for s in run:
                if _usable(s):
                    first_doc.setdefault(_split(s)[1], di)
    rng = random.Random(SEED)
    out = []
    for di, doc in enumerate(docs):
        for para in doc:
            for i in range(1, len(para)):
                if not _usable(para[i]):
                    continue
                cue, answer = _split(para[i])
                others = [s for s, dj in first_doc.items() if dj != di and s != answer]
                rng.shuffle(others)
                distractors = sorted(others, key=lambda s: abs(len(s) - len(answer)))[:CHOICES - 1]
                label = rng.randrange(CHOICES)
                choices = distractors[:label] + [answer] + distractors[label:]
                context = " ".join(para[max(0, i - CONTEXT_SENTENCES):i] + [cue])
                out.append({"context": context, "choices": choices, "label": label})
    return out


def write_task(folder: str | Path) -> str:
    """Write the task's JSONL and YAML into `folder` (for TaskManager(include_path=folder)); returns its lm-eval
    task name."""
    folder = Path(folder)
    data = folder / f"{TASK}.jsonl"
    atomic_write_bytes(data, "".join(json.dumps(it) + "\n" for it in items()).encode())
    atomic_write_bytes(folder / f"{TASK}.yaml", TASK_YAML.format(task=TASK, data=json.dumps(str(data))).encode())
    return TASK
