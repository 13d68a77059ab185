"""The leak test: which input tokens does each output of a model depend on?

Take the model's input embeddings as a leaf (a hook on the embedding layer's output, or
``inputs_embeds``) and backpropagate a random projection of a chosen set of outputs: the
gradient at every input token that none of the chosen outputs may depend on must be exactly
0 — masked attention gives exact zeros, so any nonzero value is a path the mask does not
allow. Forward passes do the same the other way round: move chosen inputs, and the outputs
that may not depend on them must not move by a single bit — they see what a gradient cannot
(a detached statistic, a custom op whose backward is masked but whose forward is not). The
passes are planned from the mask's forbidden pairs (:mod:`flexmask.testing.cover`): every
(output, input) pair the mask keeps apart is tested by some pass, both ways. A leaking pass
is then narrowed down, by more passes, to the documents and a token pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flexmask import Mask, causal, document
from flexmask.testing.passes import Probe
from flexmask.testing.report import LeakReport


def leak_test(
    model: nn.Module,
    inputs: Mapping[str, Any] | Tensor | tuple,
    mask: Mask | None = None,
    *,
    seq_lens: Any = None,
    embedding: nn.Module | None = None,
    output: Callable[[Any], Tensor] | None = None,
    method: str = "auto",
    samples: int = 2,
    seed: int = 0,
    max_examples: int = 8,
    raise_on_leak: bool = False,
    layers: int | None = None,
    train: bool | None = None,
    locate: bool = True,
) -> LeakReport:
    """Proves that no token of a packed batch reaches an output the mask keeps it from, and
    that the influences the mask allows are there (sampled).

    What it reads: the mask, densely (``(B, S, S)``, a test tool's size), and from it what
    each output may depend on through the model's layers — ``layers`` applications of the
    mask (the residual stream keeps each token's own input), or any number. Every ordered
    (output, input) pair outside that is *forbidden*, across rows and padding included; the
    passes are planned so that every forbidden pair is tested, deterministically
    (:func:`flexmask.testing.cover.plan`): one pass with every real output, ``2 *
    ceil(log2(documents))`` between documents (the tokens the mask links: a tree or a
    prefix-LM row is one), and inside every document at once, one pass per branch under a
    fork (tree siblings, a window's tokens) and the cuts that keep an output from a later
    input (``n - 1`` for the longest causal document of ``n`` tokens).

    ``method="grad"`` runs those passes backward: the input embeddings become a leaf, the
    model runs once, and each pass backpropagates a random projection of its outputs — every
    input none of them may depend on must get an exactly zero gradient. ``"perturb"`` runs
    them forward: it moves the chosen inputs and asks that the outputs that may not depend on
    them do not move by a single bit. ``"auto"`` (the default) runs both — a gradient sees
    influences far below the outputs' resolution (taken in float64), forward passes see
    what no gradient carries (a statistic under ``detach``, a custom op whose backward is
    masked but whose forward is not) — or forward passes alone when the backward fails.
    ``samples`` passes pick one random token per document and ask that every key the mask
    lets it attend reaches it (the missing influences are sampled; the leaks are not).

    What it cannot see: a leak a tested pass cancels exactly (a random projection or a
    random move makes that improbable, not impossible); an influence that the forward
    passes round away and no gradient carries; in perturb-only runs, non-deterministic
    kernels (an output that moves by itself is called a leak); a leak that depends on the
    batch (a different packing, other rows). With ``layers=None`` and a mask whose reach
    grows with depth (a sliding window), the depth is read off one probe pass (see
    :class:`LeakReport`'s ``layers``): a leak that widens every probed token's reach by a
    whole layer's worth is read as a deeper model; pass ``layers`` to rule that out.

    The model runs in the mode it is in (``train=None``): in training mode BatchNorm over
    tokens or MoE capacity limits that mix documents are leaks, and are found. Every forward
    pass draws the same random numbers (dropout masks agree between passes) and buffers
    (running statistics) are restored afterwards. Dropout on attention weights can remove
    allowed influences: ``train=False`` tests in eval mode (restored afterwards).

    A pass that leaks is narrowed down to its documents (one pass per document) and to a
    token pair (a bisection), at most ``max_examples`` times.

    Where it starts (``locate=True``): the report's ``origin`` names the first module whose
    output already depends on an input the mask keeps apart from it
    (:class:`~flexmask.testing.LeakOrigin`), e.g. ``model.layers.0.linear_attn
    (Qwen3NextGatedDeltaNet, layer type linear_attention)``. One more forward records every
    module call's per-token inputs and output (forward hooks); the leaking passes of the
    method that found the first leak are replayed on them (a backward from the recorded
    tensor, or the inputs moved again and the tensor compared), descending from the model:
    the first call directly inside it, in the order they run, whose output leaks (a block),
    then the first inside that (the mixer), and on, as long as that call was given clean
    inputs. With no leak inside a document only the passes between whole documents are
    replayed. Cheap beside the test: tens of partial backward passes (0.03 s on a 512-token
    2-layer model, 0.3% of its test; docs/leaks.md). It reads only tensors shaped
    ``(B, S, ...)`` as the embeddings are, that a module takes or returns (one level into
    tuples and mappings): a leak in a module whose output is not (a channels-first
    ``Conv1d``), or in a function called between modules (a kernel, a recurrence written
    inline), is named at the enclosing module, with ``before`` the module first given it;
    a module given no per-token tensor (a reshaped one) is taken to be given clean inputs.
    It tests each depth against the reach of the whole model (``layers``): a window one
    token too wide in every layer is named where its reach first exceeds that, a later
    layer; so is a leak that appears only when a later layer combines two clean layers'
    outputs. A module called more than once is named with the call; a module that takes
    data by a side channel (a cache kept on it, an attribute another module set) is blamed
    for it; models with no list of layers are descended the same way (their submodules in
    the order they run); a model that is not an ``nn.Module`` has nothing to hook (``origin``
    None).

    Args:
        model: any module taking the batch (ids or embeddings) and returning per-token
            outputs ``(B, S, ...)`` (a tensor, or an object with ``logits`` /
            ``last_hidden_state``, or a tuple whose first item is that).
        inputs: ``model(**inputs)`` for a mapping, ``model(inputs)`` for a tensor,
            ``model(*inputs)`` for a tuple.
        mask: what each token may attend (the batch's mask, ``(B, S)`` as the inputs).
            None: ``causal() & document(seq_lens)``, or the documents the inputs'
            ``position_ids`` describe: a document starts wherever a position does not go on
            by one from the previous token (as :func:`flexmask.check_batch` reads them).
        seq_lens: the documents, without ``mask``.
        embedding: the module whose output is the input embeddings (default: the model's
            ``get_input_embeddings()``, else its first ``nn.Embedding``); unused with
            ``inputs_embeds`` or a float tensor as input.
        output: picks the per-token output from what the model returns.
        method: ``"auto"``, ``"grad"`` or ``"perturb"``.
        samples: passes checking that allowed influences are there (0: none).
        seed: seeds the projections, the moves, the sampled tokens and the model's random
            numbers (dropout) in every forward pass.
        max_examples: leaking document pairs narrowed down to a token pair.
        raise_on_leak: raise AssertionError when something leaks or is missing.
        layers: how many times the mask applies in sequence (attention layers); None: read
            off the model when it matters (a window), else any number.
        train: None keeps the model's mode; True or False sets it for the test.
        locate: name where the first leak starts (``report.origin``); False skips it.

    Returns:
        A :class:`LeakReport`.

    Raises:
        TypeError: a model that is not callable, inputs that are not a mapping, tensor or
            tuple, a mask that is not a flexmask ``Mask``, or a wrong-typed option.
        ValueError: options out of range, a mask or ``position_ids`` that do not fit the
            batch's ``(B, S)``, outputs that are not per token.

    Example:
        >>> import collections, torch, flexmask
        >>> from flexmask.testing import leak_test
        >>> batch = flexmask.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=5)
        >>> embed = torch.nn.Embedding(10, 8)
        >>> mixer = torch.nn.Conv1d(8, 8, 2, padding=1)            # sees the previous token
        >>> def model(ids):                                        # ignores the documents
        ...     return mixer(embed(ids).transpose(1, 2))[..., :-1].transpose(1, 2)
        >>> report = leak_test(model, batch.tokens, batch.mask, embedding=embed)
        >>> report.ok, sorted(report.pairs)     # documents: 0 in row 0; 1 and 2 in row 1
        (False, [(2, 1)])
        >>> print(report.leaks[0].output, report.leaks[0].input)   # output 3 reads input 2
        3 2

        Where it starts: the first module whose output already leaks.

        >>> class Shift(torch.nn.Module):                   # each token adds the previous one
        ...     def forward(self, x):
        ...         return x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        >>> layers = dict(embed=embed, proj=torch.nn.Linear(8, 8), shift=Shift())
        >>> model = torch.nn.Sequential(collections.OrderedDict(layers))
        >>> print(leak_test(model, batch.tokens, batch.mask).origin)
        shift (Shift)
    """
    started = time.perf_counter()
    _check_arguments(
        model, inputs, mask, seq_lens, embedding, output, method, samples, seed, max_examples
    )
    _check_option("layers", layers, minimum=1, optional=True)
    if train is not None and not isinstance(train, bool):
        raise TypeError(f"train must be None (keep the model's mode), True or False, got {train!r}")
    if not isinstance(locate, bool):
        raise TypeError(f"locate must be True (name where a leak starts) or False, got {locate!r}")
    runner = _Runner(model, inputs, embedding, output, seed, train)
    with runner.prepared():
        batch, seq_len = runner.shape
        allowed = _mask(mask, seq_lens, inputs, batch, seq_len)
        probe = Probe(runner, allowed, method, layers)
        report = probe.run(samples, max_examples, locate)
    report = dataclasses.replace(report, seconds=time.perf_counter() - started)
    if raise_on_leak:
        report.raise_if_failed()
    return report


def _check_arguments(
    model: Any,
    inputs: Any,
    mask: Any,
    seq_lens: Any,
    embedding: Any,
    output: Any,
    method: Any,
    samples: Any,
    seed: Any,
    max_examples: Any,
) -> None:
    if not callable(model):
        raise TypeError(
            f"model must be an nn.Module or a callable taking the inputs, got "
            f"{type(model).__name__}"
        )
    if not isinstance(inputs, (Mapping, Tensor, tuple)):
        raise TypeError(
            f"inputs must be a mapping (model(**inputs)), a tensor (model(inputs)) or a tuple "
            f"(model(*inputs)), got {type(inputs).__name__}"
        )
    if isinstance(inputs, tuple) and not inputs:
        raise ValueError("inputs is an empty tuple: give what the model is called with")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (e.g. flexmask.causal() & flexmask.document("
            f"seq_lens)) or None, got {type(mask).__name__}"
        )
    if mask is not None and seq_lens is not None:
        raise ValueError("give mask or seq_lens, not both: the mask already holds the documents")
    if embedding is not None and not isinstance(embedding, nn.Module):
        raise TypeError(
            f"embedding must be the nn.Module whose output are the input embeddings, got "
            f"{type(embedding).__name__}"
        )
    if output is not None and not callable(output):
        raise TypeError(
            f"output must be a callable picking the per-token outputs from what the model "
            f"returns (e.g. lambda out: out.logits), got {type(output).__name__}"
        )
    if method not in ("grad", "perturb", "auto"):
        raise ValueError(f"method must be 'auto', 'grad' or 'perturb', got {method!r}")
    _check_option("samples", samples, minimum=0)
    _check_option("seed", seed, minimum=0)
    _check_option("max_examples", max_examples, minimum=0)


def _check_option(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got "
            f"{type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# ---------------------------------------------------------------------- the model, as a probe
class _Runner:
    """Runs the model with the input embeddings as a leaf (or moved), and reads its outputs."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        embedding: nn.Module | None,
        output: Callable[[Any], Tensor] | None,
        seed: int,
        train: bool | None,
    ) -> None:
        self.model, self.inputs, self.output = model, inputs, output
        self.generator = torch.Generator().manual_seed(seed)
        self.seed, self.train = seed, train
        self.embedding = embedding
        self.leaf: Tensor | None = None
        self.shift: Tensor | None = None  # added to the embeddings (perturb)
        self.grad = True
        self.shape = (0, 0)

    def prepared(self) -> Any:
        runner = self

        class _Context:
            def __enter__(self) -> None:
                runner._enter()

            def __exit__(self, *exc: Any) -> None:
                runner._exit()

        return _Context()

    def _enter(self) -> None:
        module = self.model if isinstance(self.model, nn.Module) else None
        self.was_training = module.training if module is not None else False
        self.flags: list[tuple[nn.Parameter, bool]] = []
        # Training-mode forwards update running statistics: the test leaves them as found.
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()] if module else []
        self.hook = None
        if module is not None:
            if self.train is not None:
                module.train(self.train)
            for p in module.parameters():
                self.flags.append((p, p.requires_grad))
                p.requires_grad_(False)  # only the embeddings' gradient is wanted
        embeds = self._given_embeddings()
        if embeds is None:
            target = self.embedding or _embedding_of(self.model)
            self.hook = target.register_forward_hook(self._replace)
        shape = _batch_shape(self.inputs)
        if shape is None:
            self.grad = False
            out = self.forward()
            shape = (int(out.shape[0]), int(out.shape[1]))
            self.grad = True
        self.shape = shape

    def _exit(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        for p, flag in self.flags:
            p.requires_grad_(flag)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        if isinstance(self.model, nn.Module):
            self.model.train(self.was_training)

    def _given_embeddings(self) -> Tensor | None:
        if isinstance(self.inputs, Mapping) and isinstance(
            self.inputs.get("inputs_embeds"), Tensor
        ):
            return self.inputs["inputs_embeds"]
        if isinstance(self.inputs, Tensor) and self.inputs.is_floating_point():
            return self.inputs
        return None

    def _leaf(self, embeds: Tensor) -> Tensor:
        leaf = embeds.detach().clone()
        if self.shift is not None:
            leaf = leaf + self.shift.to(leaf.dtype)
        leaf.requires_grad_(self.grad)
        self.leaf = leaf
        return leaf

    def _replace(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return self._leaf(out)

    def forward(self) -> Tensor:
        inputs = self.inputs
        embeds = self._given_embeddings()
        if embeds is not None:
            leaf = self._leaf(embeds)
            inputs = leaf if isinstance(inputs, Tensor) else {**inputs, "inputs_embeds": leaf}
        with torch.set_grad_enabled(self.grad), self._same_random_numbers():
            if isinstance(inputs, Mapping):
                result = self.model(**inputs)
            elif isinstance(inputs, tuple):
                result = self.model(*inputs)
            else:
                result = self.model(inputs)
        out = self.output(result) if self.output is not None else _per_token(result)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"output= must return a tensor of per-token outputs (B, S, ...), got "
                f"{type(out).__name__}"
            )
        if self.leaf is None:
            raise ValueError(
                "the model's input embeddings were not reached: give embedding= (the module "
                "that makes them) or inputs_embeds"
            )
        expected = tuple(self.leaf.shape[:2])
        if out.dim() < 2 or tuple(out.shape[:2]) != expected:
            raise ValueError(
                f"the model's outputs are {tuple(out.shape)}, not per token: leak_test needs "
                f"(B, S, ...) = {expected + ('...',)} as the input embeddings are; pass "
                f"output= (e.g. lambda out: out.hidden_states[-1])"
            )
        return out.reshape(out.shape[0], out.shape[1], -1)

    @contextlib.contextmanager
    def _same_random_numbers(self) -> Iterator[None]:
        """Every forward draws the same random numbers (dropout): a training-mode model
        moves its outputs only where the inputs moved."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        devices = list(range(torch.cuda.device_count())) if cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            yield


def _batch_shape(inputs: Any) -> tuple[int, int] | None:
    """``(B, S)`` from the ids or embeddings given, when they say it."""
    if isinstance(inputs, Mapping):
        first = inputs.get("input_ids", inputs.get("inputs_embeds"))
    elif isinstance(inputs, tuple):
        first = inputs[0] if inputs else None
    else:
        first = inputs
    if isinstance(first, Tensor) and first.dim() >= 2:
        return int(first.shape[0]), int(first.shape[1])
    return None


def _embedding_of(model: Any) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        found = get()
        if isinstance(found, nn.Module):
            return found
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                return module
    raise TypeError(
        "leak_test found no embedding layer: pass embedding= (the module whose output are "
        "the input embeddings) or give the model inputs_embeds"
    )


def _per_token(result: Any) -> Tensor:
    if isinstance(result, Tensor):
        return result
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise TypeError(
        f"leak_test cannot read per-token outputs from a {type(result).__name__}: pass "
        f"output= (e.g. lambda out: out.hidden_states[-1])"
    )


def _mask(mask: Mask | None, seq_lens: Any, inputs: Any, batch: int, seq_len: int) -> Tensor:
    """``(B, S, S)`` bool: what each token may attend."""
    if mask is None:
        if seq_lens is None:
            positions = inputs.get("position_ids") if isinstance(inputs, Mapping) else None
            if positions is None:
                raise TypeError(
                    "leak_test needs the documents: pass mask=, seq_lens=, or inputs with "
                    "position_ids (a document starts where they do not go on by one)"
                )
            seq_lens = _lengths_from_positions(_positions(positions, batch, seq_len))
        mask = causal() & document(seq_lens)
        name = "seq_lens"
    else:
        name = "mask"
    try:
        dense = mask.to_dense(batch, 1, seq_len, seq_len)[:, 0]
    except (ValueError, IndexError, RuntimeError) as error:
        raise ValueError(
            f"{name} does not fit the batch: the inputs are (B, S) = ({batch}, {seq_len}), "
            f"and {name} must describe that many rows of that many tokens ({error})"
        ) from error
    return dense.cpu()


def _positions(positions: Any, batch: int, seq_len: int) -> Tensor:
    if not isinstance(positions, Tensor) or positions.is_floating_point():
        raise TypeError(
            f"position_ids must be an integer tensor (B, S) or (1, S), got "
            f"{getattr(positions, 'dtype', type(positions).__name__)}"
        )
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if (
        positions.dim() != 2
        or positions.shape[1] != seq_len
        or positions.shape[0]
        not in (
            1,
            batch,
        )
    ):
        raise ValueError(
            f"position_ids must be (B, S) = ({batch}, {seq_len}) or (1, {seq_len}) as the "
            f"inputs are, got {tuple(positions.shape)}"
        )
    return positions.expand(batch, seq_len)


def _lengths_from_positions(positions: Tensor) -> list[list[int]]:
    """A document starts wherever a position does not go on by one from the previous
    token (the first token included): restarts at 0, at 1 or anywhere, as check_batch
    reads ``position_ids``."""
    rows = []
    for row in positions.long().cpu():
        step = torch.ones_like(row, dtype=torch.bool)
        step[1:] = row[1:] != row[:-1] + 1
        starts = step.nonzero().view(-1).tolist()
        ends = [*starts[1:], row.numel()]
        rows.append([e - s for s, e in zip(starts, ends, strict=True)])
    return rows
