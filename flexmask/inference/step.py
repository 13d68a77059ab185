"""One step of a generation as the loop sees it: its BlockMask and where its queries sit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch.nn.attention.flex_attention import BlockMask


def span(lens: Sequence[int], q_len: int) -> str:
    """Each row's query positions, as ``[126, 3]`` (one query) or ``[126-129, 3-6]``."""
    if q_len == 1:
        return "[" + ", ".join(map(str, lens)) + "]"
    return "[" + ", ".join(f"{n}-{n + q_len - 1}" for n in lens) + "]"


class StepSource(Protocol):
    """What a step reads of the ``DecodeMasks`` that made it: where its current step is."""

    q_len: int
    capacity: int
    _lens: list[int]
    _generation: int


class DecodeStep:
    """One step of a generation: its BlockMask and the positions its queries sit at.

    Row b's queries are positions ``cache_lens[b] .. cache_lens[b] + q_len - 1``: write their
    keys and values at those cache indices, and pass ``block_mask`` to flex_attention. A step
    is valid until its ``DecodeMasks`` makes the next one (the append path rewrites the one
    BlockMask in place); reading ``block_mask`` of an earlier step raises instead of
    returning the later step's mask.

    Example:
        >>> import flexmask
        >>> step = next(iter(flexmask.DecodeMasks(flexmask.causal(), [126, 3], capacity=512)))
        >>> step
        DecodeStep(0: queries at [126, 3], q_len=1, capacity=512, build)
        >>> step.cache_lens, step.positions
        ([126, 3], [range(126, 127), range(3, 4)])
    """

    __slots__ = (
        "_owner",
        "_generation",
        "_block_mask",
        "index",
        "_lens",
        "q_len",
        "capacity",
        "kind",
    )

    def __init__(
        self, owner: StepSource, generation: int, block_mask: BlockMask, index: int, kind: str
    ) -> None:
        self._owner = owner
        self._generation = generation
        self._block_mask = block_mask
        self.index = index
        """Steps made before this one by its ``DecodeMasks`` (0: the constructor's)."""
        self._lens = tuple(owner._lens)
        self.q_len = owner.q_len
        self.capacity = owner.capacity
        self.kind = kind
        """How its BlockMask was made: "build" (from structure), "append" or "reuse"."""

    @property
    def cache_lens(self) -> list[int]:
        """Each row's tokens in the cache before this step's queries (their first position)."""
        return list(self._lens)

    @property
    def positions(self) -> list[range]:
        """Each row's query positions (equally, the cache indices their keys go to)."""
        return [range(n, n + self.q_len) for n in self._lens]

    @property
    def block_mask(self) -> BlockMask:
        """The step's BlockMask, shape ``(B, H, q_len, capacity)``.

        Raises:
            RuntimeError: the ``DecodeMasks`` has made a later step since.
        """
        owner = self._owner
        if owner._generation != self._generation:
            raise RuntimeError(
                f"{self!r} is stale: its DecodeMasks has moved on to queries at "
                f"{span(owner._lens, owner.q_len)}, and a step's BlockMask is valid only until "
                f"the next step is made (the append path rewrites it in place). Use the step "
                f"the loop gives now (`for step in steps:` or `step = steps.at(cache_lens)`)"
            )
        return self._block_mask

    def __repr__(self) -> str:
        return (
            f"DecodeStep({self.index}: queries at {span(self._lens, self.q_len)}, "
            f"q_len={self.q_len}, capacity={self.capacity}, {self.kind})"
        )
