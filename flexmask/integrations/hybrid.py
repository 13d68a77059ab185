"""Packed rows through hybrid models' recurrent and convolution layers, one document at a time.

A hybrid model (softmax attention in some layers; Gated DeltaNet, Mamba, short convolutions,
lightning attention or an RG-LRU in others) keeps packed documents apart in its attention
layers through the mask, and in its other layers only through CUDA kernels (causal_conv1d,
mamba_ssm, fla) that take the boundaries as ``seq_idx`` / ``cu_seq_lens_q``. Without them,
transformers runs those layers over the packed row as one sequence (each document's state
flows into the next), or refuses the boundaries. :func:`keep_documents_apart` installs an
exact fallback on every such layer: the layer runs once per document, on that document's
slice of the row, with no cache and no packing arguments, and the outputs are concatenated.
"""

from __future__ import annotations

import importlib.util
import inspect
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from flexmask.integrations.hybrid_mixers import MIXERS, MixerCall, looks_recurrent

__all__ = ["HybridFallback", "keep_documents_apart"]

BOUNDARY_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "max_length_q", "max_length_k")
"""transformers' packing arguments: the fallback reads the first three and passes none of them
to a layer it runs per document (the torch path raises on ``seq_idx`` / ``cu_seqlens``)."""

_INSTALLED: weakref.WeakKeyDictionary[nn.Module, HybridFallback] = weakref.WeakKeyDictionary()


def kernels_take_boundaries(device: torch.device, packages: tuple[str, ...]) -> bool:
    """Whether the layer's kernels run here: inputs on CUDA and every package importable
    (transformers runs mamba_ssm, causal_conv1d and fla on CUDA only, else its torch path)."""
    if device.type != "cuda" or not packages:
        return False
    return all(importlib.util.find_spec(name) is not None for name in packages)


class _Boundaries:
    """Where documents start, read from one model call: ``cu_seq_lens_q`` (or ``_k``, over the
    ``B * S`` tokens laid end to end), else ``seq_idx`` (a document starts where it changes),
    else ``position_ids`` (a document starts at every position 0), else none."""

    def __init__(self, call: dict[str, Any]) -> None:
        self.call = call

    def starts(self, batch: int, seq_len: int) -> list[list[int]] | None:
        """Per row, the tokens where documents start (0 first); None: one per row."""
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            cu = self.call.get(name)
            if cu is not None:
                return _from_cu_seq_lens(cu, batch, seq_len, name)
        seq_idx = self.call.get("seq_idx")
        if seq_idx is not None:
            rows = _rows(seq_idx, batch, seq_len, "seq_idx")
            return _change_points(rows[:, 1:] != rows[:, :-1])
        positions = self.call.get("position_ids")
        if positions is not None:
            rows = _rows(positions, batch, seq_len, "position_ids")
            restart = rows[:, 1:] == 0
            padding = self.call.get("attention_mask")
            if isinstance(padding, Tensor) and tuple(padding.shape) == (batch, seq_len):
                # A left-padded row (generate's: padding at positions 0 or 1, the prompt from 0)
                # is one sequence: a restart after padding alone starts nothing.
                restart &= padding.bool().cumsum(-1)[:, :-1] > 0
            return _change_points(restart)
        return None


def _rows(value: Any, batch: int, seq_len: int, name: str) -> Tensor:
    if not isinstance(value, Tensor) or value.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got {type(value).__name__}")
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() == 3 and value.shape[0] == 3:
        value = value[0]
    if value.dim() != 2 or value.shape[-1] != seq_len or value.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must be (B, S) = ({batch}, {seq_len}) or (1, {seq_len}) as the hidden "
            f"states of the layer are, got {tuple(value.shape)}"
        )
    return value.expand(batch, seq_len)


def _change_points(new_document: Tensor) -> list[list[int]] | None:
    """Starts per row from a (B, S - 1) bool "token t + 1 starts a document"; None when no
    row has a second document."""
    if not bool(new_document.any()):
        return None
    return [[0] + (row.nonzero().view(-1) + 1).tolist() for row in new_document.cpu()]


def _from_cu_seq_lens(cu: Any, batch: int, seq_len: int, name: str) -> list[list[int]] | None:
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.is_floating_point():
        raise TypeError(f"{name} must be a 1-D integer tensor of offsets, got {cu!r}")
    offsets = cu.tolist()
    if offsets[:1] != [0] or offsets[-1] != batch * seq_len or offsets != sorted(offsets):
        raise ValueError(
            f"{name} must rise from 0 to B * S = {batch * seq_len} (the tokens of the layer's "
            f"hidden states laid end to end), got {offsets}"
        )
    rows: list[list[int]] = [[0] for _ in range(batch)]
    for offset in offsets[1:-1]:
        row, token = divmod(offset, seq_len)
        if token:
            rows[row].append(token)
    return rows if any(len(r) > 1 for r in rows) else None


class HybridFallback:
    """The fallback installed on a model by :func:`keep_documents_apart`.

    Attributes:
        layers: ``{qualified module name: mixer class name}`` of the layers it runs per
            document (when their kernels cannot keep the documents apart).
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._layers = layers
        self.layers = {name: type(module).__name__ for name, module in layers.items()}
        self._local = threading.local()
        self._hooks: list[Any] = []
        self.installed = False

    # -------------------------------------------------------------- the model's own call
    def _stack(self) -> list[_Boundaries]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = dict(kwargs)
        names = _parameter_names(module.forward)
        for name, value in zip(names, args, strict=False):
            call.setdefault(name, value)
        self._stack().append(_Boundaries(call))
        # A cache of a packed row can never be continued (each layer would hold the whole
        # row's state): a packed call that leaves use_cache unset runs without one, so that
        # transformers does not make an empty cache the fallback would have to refuse.
        if (
            ("use_cache" in names or _takes_any_keyword(module.forward))
            and call.get("use_cache") is None
            and _cache_of(call) is None
            and _packed_call(call)
        ):
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop()

    # ---------------------------------------------------------------- one mixer's call
    def _run(self, module: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
        row = MIXERS[type(module).__name__]
        names = _parameter_names(original)
        call = dict(kwargs)
        for name, value in zip(names, args, strict=False):
            call[name] = value
        hidden = args[0] if args else call.get(names[0])
        if not isinstance(hidden, Tensor) or hidden.dim() != 3:
            raise TypeError(
                f"{type(module).__name__}: the fallback needs the hidden states (B, S, D) as "
                f"its first argument, got {type(hidden).__name__}"
            )
        given = [b.call for b in self._stack()[-1:]] + [call]
        native = bool(row.native) and all(call.get(name) is not None for name in row.native)
        native = native and not (row.one_row and hidden.shape[0] > 1)
        if native and kernels_take_boundaries(hidden.device, row.packages):
            return original(*args, **kwargs)  # its kernels keep the documents apart
        batch, seq_len = int(hidden.shape[0]), int(hidden.shape[1])
        starts = _first_found(given, batch, seq_len, type(module).__name__)
        if starts is None:
            # One document per row: the layer as it is, without the arguments its torch
            # path refuses.
            kept = {k: v for k, v in kwargs.items() if k not in BOUNDARY_ARGUMENTS}
            return original(*args[:1], **{**_named(names, args[1:]), **kept})
        for name in row.state:
            if call.get(name) not in (None, False):
                raise ValueError(
                    f"{type(module).__name__} was given {name}={type(call[name]).__name__} on a "
                    f"packed row: a cache holds one state per row, and a packed row holds "
                    f"several documents, so no per-document run can fill it exactly. Call "
                    f"the model with use_cache=False (training and scoring need no cache), "
                    f"or generate from unpacked rows"
                )
        return _per_document(original, row, hidden, call, starts)

    # ---------------------------------------------------------------------- handle
    def remove(self) -> None:
        """Takes the fallback off: the model runs as before :func:`keep_documents_apart`.
        Removing twice does nothing."""
        if not self.installed:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._layers.values():
            if "forward" in vars(module):
                del module.forward
        model = self._model()
        if model is not None and _INSTALLED.get(model) is self:
            del _INSTALLED[model]
        self.installed = False

    def __enter__(self) -> HybridFallback:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        kinds = sorted(set(self.layers.values()))
        state = "installed" if self.installed else "removed"
        return f"HybridFallback({state}, {len(self.layers)} layers: {', '.join(kinds)})"


def _parameter_names(function: Any) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _takes_any_keyword(function: Any) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD for p in parameters)


def _named(names: list[str], args: tuple) -> dict[str, Any]:
    return dict(zip(names[1:], args, strict=False))


def _cache_of(call: dict[str, Any]) -> Any:
    for name in ("cache", "past_key_values", "cache_params"):
        if call.get(name) is not None:
            return call[name]
    return None


def _packed_call(call: dict[str, Any]) -> bool:
    """Whether a model call holds a row of several documents (the call's own shape)."""
    ids = call.get("input_ids")
    if ids is None:
        ids = call.get("inputs_embeds")
    if not isinstance(ids, Tensor) or ids.dim() < 2:
        return False
    try:
        return _Boundaries(call).starts(int(ids.shape[0]), int(ids.shape[1])) is not None
    except (TypeError, ValueError):
        return False


def _first_found(
    calls: list[dict[str, Any]], batch: int, seq_len: int, layer: str
) -> list[list[int]] | None:
    """The layer's own packing arguments first, else the model call's."""
    for call in reversed(calls):
        if any(call.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")):
            return _Boundaries(call).starts(batch, seq_len)
    if not calls[:-1]:
        raise RuntimeError(
            f"{layer} ran outside a call of the model keep_documents_apart was installed on "
            f"(a submodule called alone, or recomputed by activation checkpointing after the "
            f"call returned), and was given no seq_idx / cu_seq_lens_q: it cannot tell where "
            f"documents start. Call the model itself, or pass seq_idx to the layers"
        )
    return _Boundaries(calls[0]).starts(batch, seq_len)


def _cut(value: Any, start: int, end: int, row: int) -> Any:
    if isinstance(value, Tensor):
        return value[row : row + 1, start:end] if value.dim() >= 2 else value
    if isinstance(value, tuple):
        return tuple(_cut(v, start, end, row) for v in value)
    return value


def _per_document(
    original: Any, row: MixerCall, hidden: Tensor, call: dict[str, Any], starts: list[list[int]]
) -> Any:
    """The layer once per document slice ``[1, n, D]``; outputs concatenated in place."""
    seq_len = int(hidden.shape[1])
    rows: list[Tensor] = []
    extras: Any = None
    for index, row_starts in enumerate(starts):
        pieces = []
        for start, end in zip(row_starts, [*row_starts[1:], seq_len], strict=True):
            sliced = {n: _cut(call.get(n), start, end, index) for n in row.sliced if n in call}
            out = original(hidden[index : index + 1, start:end], **sliced, **row.fixed)
            if isinstance(out, tuple):
                out, extras = out[0], out[1:]
            pieces.append(out)
        rows.append(torch.cat(pieces, dim=1))
    output = torch.cat(rows, dim=0)
    if extras is not None:
        # Tuples (output, weights or state): the weights of one document are not the row's.
        return (output, *(None for _ in extras))
    return output


def _mixers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if type(module).__name__ in MIXERS:
            yield name, module


def _unknown(model: nn.Module, known: dict[str, nn.Module]) -> list[str]:
    """Modules outside and around no known mixer that look like one."""
    found = []
    for name, module in model.named_modules():
        inside = any(name == k or name.startswith(k + ".") for k in known)
        around = any(k.startswith(name + ".") or not name for k in known)
        if inside or around or not name:
            continue
        reason = looks_recurrent(module)
        if reason is not None:
            found.append(f"{name} ({type(module).__name__}): {reason}")
    return found


def keep_documents_apart(model: nn.Module) -> HybridFallback:
    """Runs every recurrent and convolution layer of a transformers hybrid model once per
    packed document, where its kernels cannot keep the documents apart.

    One call installs, on each sequence-mixing layer the model has (Gated DeltaNet and Kimi
    Delta Attention, Mamba-1 and Mamba-2, short convolutions, MiniMax's lightning attention,
    RecurrentGemma's RG-LRU block: the classes of :data:`flexmask.integrations.hybrid_mixers.
    MIXERS`), a forward that splits each row at its document starts and runs the original
    layer on every slice ``[1, n, D]`` with its state starting from zero — no cache, no
    attention mask, no packing arguments — then concatenates: exactly what each document
    gives alone, with autograd through every slice. The attention layers and everything else
    run unchanged; their masks come from :func:`flexmask.integrations.transformers.
    model_inputs` as for any model.

    Where documents start is read from each call of ``model``, by transformers' names:
    ``cu_seq_lens_q`` (or ``cu_seq_lens_k``) over the ``B * S`` tokens end to end, else
    ``seq_idx`` (a document starts where it changes), else ``position_ids``: a document
    starts at every token whose position is 0 — as transformers' own flash path reads a
    packed row, and as ``flexmask.pack`` and ``DataCollatorWithFlattening`` lay it out (a
    padding token of ``flexmask.pack``, at position 0, is a document of its own), except
    after nothing but padding in a 2-D ``attention_mask`` (``generate``'s left padding). A row with
    no second start runs the layer as it was, minus the packing arguments (so generation,
    one token at a time, is untouched). Those arguments never reach a layer run per document.

    A layer is left alone, per call, when its kernels take the boundaries: inputs on CUDA,
    the layer's kernel packages importable (``mamba_ssm`` and ``causal_conv1d`` for Mamba-2,
    ``fla`` and ``causal_conv1d`` for the Gated DeltaNet, ``causal_conv1d`` for short
    convolutions) and the call giving it what they read (``seq_idx``; ``cu_seq_lens_q`` and
    ``seq_idx``, on one row, for the Gated DeltaNet). Kimi Delta Attention, Mamba-1,
    lightning attention and the RG-LRU get no boundaries into any kernel in transformers
    5.25: always per document.

    A packed call that does not set ``use_cache`` runs with ``use_cache=False``: a cache
    holds one state per row and cannot hold several documents. A layer given a cache on a
    packed row raises ValueError.

    Args:
        model: a transformers model (``...ForCausalLM`` or its base model); installing twice
            returns the handle already installed.

    Returns:
        A :class:`HybridFallback`; ``.remove()`` takes it off (also as a context manager).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no recurrent or convolution layer flexmask knows (attention
            alone needs only the masks), or has a layer that looks recurrent (a state space's
            parameters, a depthwise convolution, a mixer's name) whose class flexmask does
            not know how to run per document.

    Example:
        >>> import torch, flexmask
        >>> from transformers import AutoModelForCausalLM, Lfm2Config
        >>> from flexmask.integrations.hybrid import keep_documents_apart
        >>> config = Lfm2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                     num_hidden_layers=2, num_attention_heads=2,
        ...                     num_key_value_heads=1, layer_types=["conv", "full_attention"])
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        >>> handle = keep_documents_apart(model)
        >>> handle
        HybridFallback(installed, 1 layers: Lfm2ShortConv)
        >>> ids = torch.tensor([[3, 4, 5, 6, 7]])          # documents [3, 4, 5] and [6, 7]
        >>> positions = torch.tensor([[0, 1, 2, 0, 1]])
        >>> mask = (flexmask.causal() & flexmask.document([3, 2])).to_dense(1, 1, 5, 5)
        >>> packed = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        >>> alone = model(input_ids=ids[:, 3:]).logits
        >>> torch.allclose(packed[:, 3:], alone, atol=1e-5)
        True
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers model (an nn.Module), got {type(model).__name__}"
        )
    existing = _INSTALLED.get(model)
    if existing is not None and existing.installed:
        return existing
    layers = dict(_mixers(model))
    unknown = _unknown(model, layers)
    if unknown:
        raise ValueError(
            "keep_documents_apart does not know how to run these layers per document, and "
            "they look like they carry state from token to token (one document into the "
            "next, in a packed row): " + "; ".join(unknown[:5]) + ". Known mixer classes: "
            "flexmask.integrations.hybrid_mixers.MIXERS"
        )
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no recurrent or convolution layer flexmask knows "
            f"(flexmask.integrations.hybrid_mixers.MIXERS): its attention layers keep packed "
            f"documents apart through the masks alone "
            f"(flexmask.integrations.transformers.model_inputs)"
        )
    handle = HybridFallback(model, layers)
    for module in layers.values():
        original = module.forward

        def forward(self: nn.Module, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return handle._run(self, _original, args, kwargs)

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    handle._hooks.append(model.register_forward_pre_hook(handle._enter, with_kwargs=True))
    handle._hooks.append(
        model.register_forward_hook(handle._exit, with_kwargs=True, always_call=True)
    )
    handle.installed = True
    _INSTALLED[model] = handle
    return handle
