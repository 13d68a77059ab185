"""A synthetic language with learnable structure, generated on the spot (no downloads).

Usage::

    docs = make_corpus(1000, seed=0)          # list of Document(task, tokens)
    print(describe(docs[0]))                  # "arith: ARITH 17 20 23 26 ..."

Every document starts with a task token and follows one of three rules, so a model can only
predict most tokens by looking back inside its own document:

* ``arith``: ``ARITH a, a+d, a+2d, ...`` (mod 32). After two numbers the rest is determined.
* ``copy``: ``COPY x1 .. xk SEP x1 .. xk``. The second half repeats the first (induction).
* ``repeat``: ``REPEAT m1 .. mp m1 .. mp ...``: a short motif over and over, up to 160 tokens.

Lengths range from 9 to 160 tokens, so packing has work to do. The first half of a copy
document and the first motif of a repeat document are random: they set a loss floor
(about 1.6 nats per token on copy documents, well under 0.5 on the others).
"""

from __future__ import annotations

import random
from typing import NamedTuple

PAD, SEP, ARITH, COPY, REPEAT = 0, 1, 2, 3, 4
NUMBERS = range(8, 40)  # 32 numbers: arithmetic mod 32
LETTERS = range(40, 64)  # 24 letters: copy and repeat content
VOCAB = 64
TASKS = ("arith", "copy", "repeat")
_NAMES = {PAD: "PAD", SEP: "SEP", ARITH: "ARITH", COPY: "COPY", REPEAT: "REPEAT"}


class Document(NamedTuple):
    """One document: its task name and its token ids."""

    task: str
    tokens: list[int]


def _arith(rng: random.Random) -> list[int]:
    start, step, length = rng.randrange(32), rng.randint(1, 4), rng.randint(8, 48)
    return [ARITH] + [NUMBERS[(start + i * step) % 32] for i in range(length)]


def _copy(rng: random.Random) -> list[int]:
    content = [rng.choice(LETTERS) for _ in range(rng.randint(3, 12))]
    return [COPY, *content, SEP, *content]


def _repeat(rng: random.Random) -> list[int]:
    motif = [rng.choice(LETTERS) for _ in range(rng.randint(2, 6))]
    length = rng.randint(16, 160)
    return [REPEAT] + [motif[i % len(motif)] for i in range(length - 1)]


_MAKERS = {"arith": _arith, "copy": _copy, "repeat": _repeat}


def make_corpus(num_docs: int, seed: int = 0) -> list[Document]:
    """``num_docs`` documents, tasks drawn uniformly, reproducible from ``seed``."""
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        task = rng.choice(TASKS)
        docs.append(Document(task, _MAKERS[task](rng)))
    return docs


def describe(doc: Document, limit: int = 16) -> str:
    """A readable rendering of a document's first ``limit`` tokens."""

    def name(token: int) -> str:
        if token in _NAMES:
            return _NAMES[token]
        if token in NUMBERS:
            return str(token - NUMBERS.start)
        return chr(ord("a") + token - LETTERS.start)

    shown = " ".join(name(t) for t in doc.tokens[:limit])
    more = f" ... ({len(doc.tokens)} tokens)" if len(doc.tokens) > limit else ""
    return f"{doc.task}: {shown}{more}"
