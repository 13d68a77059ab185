"""The one walk of the operators: ``&``, ``|`` and ``~`` over their children, and an answer
at everything else (pieces, ``per_head``, masks written outside flexmask).

A consumer that combines its children's answers (a lowering's lines, its stretches) hands
``fold`` what to do at a leaf and how ``&``, ``|`` and ``~`` combine answers; one that looks
for something (the factors of an ``&``, the first node whose heads differ) asks ``conjuncts``
or ``leaves``. None of them tests for ``And``, ``Or`` or ``Not`` itself, so a new operator is
taught here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import reduce
from typing import TypeVar

from flexmask.algebra.mask import And, Mask, Not, Or

T = TypeVar("T")


def fold(
    mask: Mask,
    leaf: Callable[[Mask], T],
    meet: Callable[[T, T], T],
    join: Callable[[T, T], T],
    complement: Callable[[T], T],
    *,
    whole: Callable[[Mask], T | None] | None = None,
    settle: Callable[[Mask, T], T] | None = None,
) -> T:
    """``mask``'s answer: ``leaf(node)`` below the operators, combined left to right by
    ``meet`` over an ``&``'s children, ``join`` over an ``|``'s, and ``complement`` for a
    ``~``.

    ``whole(node)``, asked first at every ``&`` and ``|``, answers for the node at once
    where it can (None: walk its children); ``settle(node, answer)`` revises an ``&``'s or
    ``|``'s combined answer with what the node knows (the builders' tile classification:
    a sub-expression in closed form, undecided tiles refined from an ``&``'s intervals).

    Example:
        >>> import flexmask
        >>> from flexmask.algebra.walk import fold
        >>> mask = flexmask.causal() & ~(flexmask.prefix(3) | flexmask.full())
        >>> fold(mask, lambda m: repr(m), "({} & {})".format, "({} | {})".format, "~{}".format)
        '(causal() & ~(prefix(3) | full()))'
    """

    def walk(node: Mask) -> T:
        if isinstance(node, And | Or):
            if whole is not None and (known := whole(node)) is not None:
                return known
            combine = meet if isinstance(node, And) else join
            combined = reduce(combine, (walk(child) for child in node.children))
            return combined if settle is None else settle(node, combined)
        if isinstance(node, Not):
            return complement(walk(node.child))
        return leaf(node)

    return walk(mask)


def leaves(mask: Mask) -> Iterator[Mask]:
    """The nodes below the operators, breadth-first through ``&``, ``|`` and ``~``."""
    queue = [mask]
    while queue:
        node = queue.pop(0)
        if isinstance(node, And | Or):
            queue.extend(node.children)
        elif isinstance(node, Not):
            queue.append(node.child)
        else:
            yield node


def conjuncts(mask: Mask) -> tuple[Mask, ...]:
    """The parts an ``&`` joins (the mask itself when it is no ``&``)."""
    return tuple(mask.children) if isinstance(mask, And) else (mask,)
