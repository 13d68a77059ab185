"""Is my packing right? :func:`check_batch`: every input of a training step describes the
same documents, and every kernel argument attends what the batch's mask says.

A packed batch goes wrong silently: an all-ones ``attention_mask`` lets transformers attend
across documents, a dropped ``seq_lens`` or ``position_ids`` merges them, padded
``cu_seqlens`` passed as the real ones give padding to a document, a mask made for other
lengths cuts documents in the wrong place; the loss goes down either way. The check reads
every input it is given, compares them token by token, and names the first disagreement:
the row, the token, the inputs that disagree, and what each says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import env_bool
from flexmask.algebra import Mask
from flexmask.formats import FlashMask, MagiMask, VarlenMask
from flexmask.packing import inputs, kernel_args, segments
from flexmask.packing.segments import Claim, Disagreement, previous
from flexmask.pieces import causal, document
from flexmask.runtime import LazyBlockMask

ENV_CHECK = "FLEXMASK_CHECK"
"""Set to 1 to run :func:`check_batch` in ``pack``, ``pack_tree_batch`` and the collators."""


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """What :func:`check_batch` found.

    Attributes:
        disagreements: every disagreement, the first per check, by ``(row, token)``.
        checked: the inputs that were read.
        reference: the input the documents were read from (the first given of ``seq_lens``,
            a mask's documents, ``cu_seqlens``, ``attention_mask``, ``seq_idx``,
            ``position_ids``).
        documents: how many documents the reference holds.
        mask: the mask kernel arguments were checked against: the one given, else causal
            attention inside the documents read.
    """

    disagreements: tuple[Disagreement, ...]
    checked: tuple[str, ...]
    reference: str | None
    documents: int
    mask: Mask | None = None

    @property
    def ok(self) -> bool:
        """True when every input agrees."""
        return not self.disagreements

    @property
    def first(self) -> Disagreement | None:
        """The first disagreement by ``(row, token)``, or None."""
        return self.disagreements[0] if self.disagreements else None

    def raise_if_failed(self) -> BatchReport:
        """Raises ValueError naming the first disagreement (and how many more); else returns
        the report."""
        if self.disagreements:
            more = len(self.disagreements) - 1
            raise ValueError(
                f"the batch's inputs disagree at {_where(self.disagreements[0])}"
                + (f" ({more} more: see check_batch's report)" if more else "")
            )
        return self

    def __str__(self) -> str:
        if not self.disagreements:
            return (
                f"ok: {', '.join(self.checked)} agree on {self.documents} documents "
                f"(read from {self.reference})"
            )
        return "\n".join(_where(d) for d in self.disagreements)


def _where(d: Disagreement) -> str:
    return f"row {d.row}, token {d.token} ({' vs '.join(d.inputs)}): {d.message}"


def check_enabled(check: bool | None) -> bool:
    """``check`` itself, or for None the environment variable FLEXMASK_CHECK (1/0, true/false,
    on/off, yes/no; unset: off)."""
    if check is not None:
        if not isinstance(check, bool):
            raise TypeError(f"check must be True, False or None, got {check!r}")
        return check
    return env_bool(ENV_CHECK, False)


def check_batch(
    *,
    batch: Any = None,
    input_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | BlockMask | LazyBlockMask | None = None,
    padding_mask: Tensor | None = None,
    labels: Tensor | None = None,
    loss_mask: Tensor | None = None,
    labels_shifted: bool | None = None,
    ignore_index: int = -100,
    seq_lens: Any = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Any = None,
    cu_seqlens_padded: Any = None,
    max_seqlen: int | None = None,
    cu_seq_lens_q: Any = None,
    cu_seq_lens_k: Any = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    causal_kernel: bool | None = None,
    window_size: tuple[int, int] = (-1, -1),
    mask: Mask | None = None,
    block_mask: BlockMask | LazyBlockMask | None = None,
    varlen: VarlenMask | None = None,
    flashmask: FlashMask | None = None,
    magi: MagiMask | None = None,
    kernel: str | None = None,
    shape: tuple[int, int] | None = None,
    raise_on_error: bool = False,
) -> BatchReport:
    """Checks that the inputs of a training step describe the same packed documents.

    Give any of the inputs below; each is compared with the others, token by token:

    * documents start where ``position_ids`` restart at 0 (and nowhere else), where
      ``seq_idx`` changes, where ``seq_lens``, ``cu_seqlens`` or the mask's ``document``
      start one; ``cu_seqlens`` are the real boundaries (with ``cu_seqlens_padded``, the
      padded slots hold padding only past each sequence's real length);
    * padding (no document) is where a 0/1 ``attention_mask`` is 0, past ``sum(seq_lens)``,
      outside every ``cu_seqlens`` sequence; a 0/1 ``attention_mask`` holds one document per
      row — with several, transformers attends across them (it ignores ``position_ids`` once
      an ``attention_mask`` is given);
    * no label crosses a document: a token trained on (``labels != ignore_index``, or
      ``loss_mask``) is predicted from a token of its own document, never at padding;
    * every kernel argument attends exactly what the batch's mask attends, on every real
      query row: a ``block_mask`` (or a 4-D ``attention_mask``: bool, 0/1 integer or
      additive float) is for these lengths, tiled as ``kernel`` takes it, and lists the same
      blocks with the same elements — a BlockMask on both sides, its kv side (the forward)
      and its q side (``q_indices``/``full_q_indices``: what torch's backward reads for dK
      and dV); ``varlen``, ``flashmask`` and ``magi`` arguments, and ``cu_seqlens`` under a
      kernel that is causal or not (``causal_kernel``), attend the same pairs;
    * no real token's row of the mask attends nothing.

    The batch's mask is ``mask`` (or ``batch.mask``); without one, causal attention inside
    the documents the inputs describe.

    Cost: a few tensor ops per input over the ``B * S`` tokens. A lazy handle of the
    batch's mask is recognised without building it; a BlockMask is read on its partial
    blocks (element by element: the diagonal and document edges), a dense mask on every
    element.

    Args:
        batch: a :class:`~flexmask.packing.PackedBatch` (its tokens, shifted labels, positions,
            documents, and lazy handle), a :class:`~flexmask.packing.TreeBatch` or
            :class:`~flexmask.packing.TreePack`.
        input_ids: ``(B, S)`` token ids: the batch's shape, and how ``labels`` are aligned.
        position_ids: ``(B, S)`` (or ``(1, S)``, read for every row) positions given to the
            model.
        attention_mask: a 2-D ``(B, S)`` mask (0 at padding; values above 1 are segment ids,
            one per document), or what a model's attention reads: a 4-D ``(B, 1 or H, S, S)``
            bool (True attends), 0/1 integer (1 attends) or additive float mask (0 attends;
            a value at or below -1000 masks: transformers' ``finfo.min``, ``-inf`` and its
            legacy ``-10000.0``), or a BlockMask.
            A 2-D 0/1 one is read as transformers reads it: one sequence per row.
        padding_mask: ``(B, S)``, True (or 1) at real tokens, False at padding, and nothing
            about documents (TransformerEngine's THD slots, padded rows).
        labels: ``(B, S)`` targets, ``ignore_index`` where nothing is trained.
        loss_mask: ``(B, S)`` bool, True where the label at that position is trained.
        labels_shifted: True when ``labels[b, p]`` is the target of the logits at ``p``
            (flexmask's ``pack``: already shifted); False when the model shifts them
            (transformers: ``labels[b, p]`` is predicted from the logits at ``p - 1``). None:
            read off ``input_ids`` (the convention under which more labels equal their token).
        ignore_index: the label of untrained positions.
        seq_lens: document lengths, one list per row (or one list for every row), back to
            back from token 0 as ``flexmask.document`` takes them: whole numbers >= 0 (a
            TypeError or ValueError naming the entry otherwise).
        seq_idx: ``(B, S)`` document index of every token (Mamba kernels' ``seq_idx``).
        cu_seqlens: cumulative real lengths over the ``B * S`` tokens laid end to end.
        cu_seqlens_padded: cumulative padded lengths (TransformerEngine's THD layout).
        max_seqlen: the kernel's ``max_seqlen``: at least the longest sequence.
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: transformers' names for
            ``cu_seqlens`` and ``max_seqlen`` (``DataCollatorWithFlattening(
            return_flash_attn_kwargs=True)`` returns them, so ``check_batch(**collated)``
            reads its output as it is). The q and k values must be the same boundaries (a
            packed batch attends within itself) and agree with ``cu_seqlens``/``max_seqlen``
            when both are given, else ValueError naming the two.
        causal_kernel: the varlen kernel's ``causal`` flag for ``cu_seqlens`` (transformers'
            flash path is causal); None: ``cu_seqlens`` only as document boundaries.
        window_size: the varlen kernel's ``(left, right)`` window, ``-1`` unbounded.
        mask: the flexmask mask the batch means (``causal() & document(seq_lens)``, a tree,
            a prefix-LM ...).
        block_mask: the BlockMask (or lazy handle) the attention reads.
        varlen, flashmask, magi: arguments lowered for those kernels
            (``flexmask.to_varlen`` / ``to_flashmask`` / ``to_magi`` give them).
        kernel: the kernel the BlockMask goes to: ``"flex"`` (torch's Triton kernel: block
            sizes that are multiples of 128) or ``"flexmask"`` (any block size). None: no
            block-size check.
        shape: ``(B, S)``. Needed when no per-token tensor gives it; given with them, it
            must agree with each (a ``(1, S)`` tensor is read for each of its B rows), else
            ValueError.
        raise_on_error: raise ValueError at the first disagreement (for training loops).

    Returns:
        A :class:`BatchReport`; ``report.ok`` when everything agrees.

    Raises:
        TypeError, ValueError: an input that cannot be read as its argument says (a shape
            or dtype it cannot take, ``seq_lens`` that are not lengths, per-token inputs or
            ``shape`` that disagree on B or S, a 4-D integer mask with values other than
            0/1), naming it; ValueError at the first disagreement with ``raise_on_error``.

    Example:
        >>> import torch, flexmask
        >>> batch = flexmask.pack([[1, 2, 3], [4, 5]], max_len=5)
        >>> flexmask.check_batch(batch=batch).ok
        True
        >>> ones = torch.ones_like(batch.tokens)          # an all-ones mask on a packed batch
        >>> report = flexmask.check_batch(batch=batch, attention_mask=ones)
        >>> print(report.first.inputs, report.first.row, report.first.token)
        ('attention_mask', "batch.mask's documents") 0 3
    """
    checks = _Inputs.gather(inputs.transformers_names(locals()))
    report = checks.run()
    if raise_on_error:
        report.raise_if_failed()
    return report


class _Inputs:
    """The given inputs, read into claims, and the checks between them."""

    def __init__(self, given: dict[str, Any]) -> None:
        self.given = given
        self.issues: list[Disagreement] = []
        self.claims: list[Claim] = []
        self.checked: list[str] = []

    @classmethod
    def gather(cls, given: dict[str, Any]) -> _Inputs:
        given = dict(given)
        batch = given.pop("batch")
        if batch is not None:
            _from_batch(batch, given)
        return cls(given)

    # ------------------------------------------------------------------ the pipeline
    def run(self) -> BatchReport:
        g = self.given
        shape = inputs.shape_of(g)
        mask: Mask | None = g["mask"]
        mask_name = g.get("mask_name", "mask")
        self._read_claims(shape)
        if mask is not None:
            claims, issues = segments.mask_claims(mask, mask_name, shape)
            self.claims[:0] = claims  # a mask's documents are the reference when given
            self.issues += issues
            self.checked.append(mask_name)
        start, start_from, real, real_from = self._reference(shape)
        self._compare_claims(start, start_from, real, real_from)
        self._positions(start, start_from, real, mask, shape)
        self._labels(start, start_from, real, real_from, shape)
        derived = mask is None
        if mask is None:
            mask = causal() & document(segments.runs(start, real))
            mask_name = f"causal documents of {start_from or real_from or 'the batch'}"
        try:
            kernel_args.check_mask(
                mask, mask_name, start, real, shape, self.issues, self.claims, derived
            )
        except ValueError as error:  # made for another batch: nothing to compare with
            self.issues.append(
                Disagreement(
                    0,
                    0,
                    (mask_name, "the batch"),
                    f"{mask_name} cannot apply to a {shape[0]} x {shape[1]} batch: {error}",
                )
            )
            mask = None
        for name in ("attention_mask", "block_mask", "varlen", "flashmask", "magi"):
            value = g.get(name)
            if value is None or mask is None or (name == "attention_mask" and _is_2d(value)):
                continue
            self.checked.append(name)
            kernel_args.check(name, value, mask, mask_name, real, shape, g, self.issues)
        if g["cu_seqlens"] is not None and g["causal_kernel"] is not None and mask is not None:
            kernel_args.check_cu_seqlens(mask, mask_name, real, shape, g, self.issues)
        issues = sorted(self.issues, key=lambda d: (d.row, d.token))
        documents = int((start & real).sum()) if start is not None else shape[0]
        return BatchReport(
            tuple(issues), tuple(self.checked), start_from or real_from, documents, mask
        )

    def _read_claims(self, shape: tuple[int, int]) -> None:
        g = self.given
        if g["seq_lens"] is not None:
            rows = inputs.length_rows(g["seq_lens"])
            claim, issues = segments.from_lengths(g.get("seq_lens_name", "seq_lens"), rows, shape)
            self._add(claim, issues)
        if g["padding_mask"] is not None:
            pad = segments.as_rows(g["padding_mask"], "padding_mask", shape)
            self._add(segments.Claim("padding_mask", None, pad.bool()), [])
        if g["cu_seqlens"] is not None or g["cu_seqlens_padded"] is not None:
            claim, issues = segments.from_cu_seqlens(
                g["cu_seqlens"], g["cu_seqlens_padded"], shape, g["max_seqlen"]
            )
            self._add(claim, issues)
        if g["seq_idx"] is not None:
            seq_idx = segments.integer(segments.as_rows(g["seq_idx"], "seq_idx", shape), "seq_idx")
            self._add(segments.from_seq_idx(seq_idx), [])
        tree = g["mask"] is not None and segments.has_tree(g["mask"])
        if g["position_ids"] is not None and not tree:  # a tree's positions are depths
            positions = inputs.positions(g["position_ids"], shape)
            self._add(segments.from_positions(positions), [])
        elif g["position_ids"] is not None:
            self.checked.append("position_ids")
        am = g["attention_mask"]
        if am is not None and _is_2d(am):
            claim, segment_ids = segments.from_attention_mask(
                segments.as_rows(am, "attention_mask", shape)
            )
            # Segment ids place documents; a 0/1 mask only padding (one sequence per row):
            # positions, seq_idx and lengths say better where documents start.
            if segment_ids:
                self.claims.insert(0, claim)
                self.checked.append("attention_mask")
            else:
                self._add(claim, [])

    def _add(self, claim: Claim, issues: list[Disagreement]) -> None:
        self.claims.append(claim)
        self.issues += issues
        self.checked.append(claim.name.split(" (")[0].split("'s ")[0])

    def _reference(self, shape: tuple[int, int]) -> tuple[Tensor, str | None, Tensor, str | None]:
        start = next((c for c in self.claims if c.start is not None), None)
        real = next((c for c in self.claims if c.real is not None), None)
        real_t = real.real if real is not None else torch.ones(shape, dtype=torch.bool)
        assert real_t is not None
        if start is not None and start.start is not None:
            start_t = start.start & real_t
            if start.real is None:  # positions: a real token after padding starts one too
                start_t = start_t | (real_t & ~previous(real_t, False))
        else:
            start_t = real_t & ~previous(real_t, False)
        return (
            start_t,
            start.name if start is not None else None,
            real_t,
            real.name if real is not None else None,
        )

    # ------------------------------------------------------------------ comparisons
    def _compare_claims(
        self, start: Tensor, start_from: str | None, real: Tensor, real_from: str | None
    ) -> None:
        inner = real & previous(real, False)
        for claim in self.claims:
            if claim.real is not None and real_from is not None and claim.name != real_from:
                differs = claim.real != real
                if claim.start is not None:
                    # A run of padding as a sequence of its own (transformers' flash path
                    # makes each pad token one) attends only padding: no harm.
                    differs &= ~(claim.real & ~real & ~_holds_real(claim.start, real))
                if bool(differs.any()):
                    b, p = _first(differs)
                    said = "padding" if bool(claim.real[b, p]) is False else "in a document"
                    other = "in a document" if said == "padding" else "padding"
                    self.issues.append(
                        Disagreement(
                            b,
                            p,
                            (claim.name, real_from),
                            f"{claim.name} says token {p} is {said}, {real_from} says {other}",
                        )
                    )
            if claim.start is None or start_from is None or claim.name == start_from:
                continue
            where = (real & claim.real) if claim.real is not None else inner
            differs = (claim.start != start) & where
            if bool(differs.any()):
                b, p = _first(differs)
                self.issues.append(_start_issue(claim, start_from, start, b, p, self))

    def _positions(
        self,
        start: Tensor,
        start_from: str | None,
        real: Tensor,
        mask: Mask | None,
        shape: tuple[int, int],
    ) -> None:
        if self.given["position_ids"] is None:
            return
        positions = inputs.positions(self.given["position_ids"], shape)
        depth = segments.tree_depths(mask, shape) if mask is not None else None
        if depth is not None:
            wrong = (positions != depth) & (depth >= 0) & real
            if bool(wrong.any()):
                b, p = _first(wrong)
                self.issues.append(
                    Disagreement(
                        b,
                        p,
                        ("position_ids", f"{self.given.get('mask_name', 'mask')}'s tree"),
                        f"position_ids[{b}, {p}] = {int(positions[b, p])}, but the token's "
                        f"depth in the tree is {int(depth[b, p])}",
                    )
                )
            return
        wrong = start & real & (positions != 0)
        if bool(wrong.any()):
            b, p = _first(wrong)
            was = int(positions[b, p - 1]) if p > 0 else None
            self.issues.append(
                Disagreement(
                    b,
                    p,
                    ("position_ids", start_from or "position_ids"),
                    f"a document starts at token {p} but position_ids do not restart at 0 "
                    f"there: {int(positions[b, p])}" + (f" after {was}" if was is not None else ""),
                )
            )

    def _labels(
        self,
        start: Tensor,
        start_from: str | None,
        real: Tensor,
        real_from: str | None,
        shape: tuple[int, int],
    ) -> None:
        g = self.given
        for name in ("labels", "loss_mask"):
            value = g[name]
            if value is None:
                continue
            self.checked.append(name)
            value = segments.as_rows(value, name, shape)
            trained = value.bool() if name == "loss_mask" else value != g["ignore_index"]
            shifted = _shifted(g, value if name == "labels" else None, trained)
            if shifted:
                # labels[p] is predicted by the logits at p: p + 1 must be in p's document.
                same = real & segments.following(real & ~start, False)
                what = "the next token, {q}, is in another document or padding"
            else:
                # labels[p] is predicted by the logits at p - 1, which must be in p's document;
                # the first label of a row is never predicted (transformers drops it).
                same = real & ~start
                same[:, 0] = True
                what = "it is the first token of its document: the logits at {q} are another's"
            crossing = trained & ~same
            if bool(crossing.any()):
                b, p = _first(crossing)
                q = p + 1 if shifted else p - 1
                why = (
                    "it is padding"
                    if not bool(real[b, p])
                    else what.format(q=q if 0 <= q < shape[1] else "none")
                )
                self.issues.append(
                    Disagreement(
                        b,
                        p,
                        (name, start_from or real_from or "the batch"),
                        f"{name} trains token {p} ({'shifted' if shifted else 'unshifted'}"
                        f" labels), but {why}: the loss predicts across documents",
                    )
                )


def _start_issue(
    claim: Claim, start_from: str, start: Tensor, b: int, p: int, inputs: _Inputs
) -> Disagreement:
    claim_starts = bool(claim.start[b, p]) if claim.start is not None else False
    says, other = (claim.name, start_from) if claim_starts else (start_from, claim.name)
    message = f"{says} starts a document at token {p}, {other} does not"
    if claim.name == "attention_mask" and not claim_starts:
        message += (
            ": a 0/1 attention_mask makes each row one sequence, so transformers attends "
            "across the packed documents (pass no attention_mask with packed position_ids, "
            "or a 4-D mask / BlockMask of the documents)"
        )
    if claim.name == "position_ids" and not claim_starts:
        message += " (position_ids go on across the boundary)"
    return Disagreement(b, p, (claim.name, start_from), message)


def _holds_real(start: Tensor, real: Tensor) -> Tensor:
    """Per token, whether the document it is in (by ``start``, over the rows laid end to end)
    holds a token ``real`` calls real."""
    doc = start.reshape(-1).long().cumsum(0)
    holds = torch.zeros(int(doc[-1]) + 1 if doc.numel() else 1, dtype=torch.int64)
    holds.index_add_(0, doc, real.reshape(-1).long())
    return (holds > 0)[doc].view(start.shape)


def _first(where: Tensor) -> tuple[int, int]:
    flat = int(torch.argmax(where.reshape(-1).to(torch.uint8)))
    return flat // where.shape[1], flat % where.shape[1]


def _shifted(given: dict[str, Any], labels: Tensor | None, trained: Tensor) -> bool:
    choice = given["labels_shifted"]
    if choice is not None:
        return bool(choice)
    ids = given["input_ids"]
    if labels is None or ids is None:
        raise TypeError(
            "pass labels_shifted=True (labels[p] is the target of the logits at p, as "
            "flexmask.pack writes them) or False (the model shifts them, as transformers "
            "does); with input_ids it is read off the labels"
        )
    ids = segments.as_rows(ids, "input_ids", tuple(labels.shape))  # type: ignore[arg-type]
    same = int(((labels == ids) & trained).sum())
    nxt = int(((labels == segments.following(ids, -1)) & trained).sum())
    return nxt > same


def _from_batch(batch: Any, given: dict[str, Any]) -> None:
    """A PackedBatch, TreeBatch or TreePack: its tensors, as far as not given explicitly."""
    tokens = getattr(batch, "tokens", None)
    if tokens is None or not hasattr(batch, "mask"):
        raise TypeError(
            f"batch must be a PackedBatch, TreeBatch or TreePack, got {type(batch).__name__}"
        )
    one_row = tokens.dim() == 1
    for name, attr in (("input_ids", "tokens"), ("position_ids", "position_ids")):
        value = getattr(batch, attr, None)
        if given[name] is None and value is not None:
            given[name] = value.unsqueeze(0) if one_row else value
    if given["labels"] is None and getattr(batch, "labels", None) is not None:
        given["labels"] = batch.labels
        given["labels_shifted"] = (
            True if given["labels_shifted"] is None else given["labels_shifted"]
        )
    if given["mask"] is None:
        given["mask"] = batch.mask
        given["mask_name"] = "batch.mask"
    handle = getattr(batch, "handle", None)
    if given["block_mask"] is None and handle is not None:
        given["block_mask"] = handle


def _is_2d(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() <= 2
