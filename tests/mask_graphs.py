"""A mask_mod's graph as inductor's flex lowering sees it, and torch's own verdicts on it.

Two ways to get the graph:

* ``traced`` — make_fx of the mask_mod the way torch's flex_attention higher-order op traces
  it (``TransformGetItemToIndex``, four distinct 0-d int32 indices), with every tensor the
  mask_mod holds lifted to a placeholder after them (inductor's aux tensors). Milliseconds:
  for hypothesis.
* ``compiled_graphs`` — the graph inductor hands its lowering, caught by wrapping
  ``torch._inductor.lowering.lowerings[flex_attention]`` while ``torch.compile(flex_attention)``
  runs on the CPU (``args[4][-1].graph_module``; the aux tensors are ``args[8]``). Seconds.

``verdicts`` asks torch's FLASH analyses about a graph: ``select_packed_mask_intervals``
(the intervals, or None: key by key) and ``select_mask_mod_vec_size`` (32 where the aux loads
vectorise, None where they do not), as on SM100 (``supports_mask_mod_vec=True``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
from torch._inductor.kernel.flex.aux_vectorization import select_mask_mod_vec_size
from torch._inductor.kernel.flex.flex_flash_attention import is_trivial_mask_graph
from torch._inductor.kernel.flex.interval_mask_packing import select_packed_mask_intervals
from torch._inductor.sizevars import SizeVarAllocator
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx


class Verdict(NamedTuple):
    intervals: int | None
    """How many packed intervals torch found, None where it refused the mask."""
    vec_size: int | None
    """The aux loads' vector width torch chose, None where they do not vectorise."""
    trivial: bool
    """torch reads the graph as no mask at all (FLASH then skips the block lists)."""
    code: str


class _Shape:
    """What select_mask_mod_vec_size reads of an aux buffer (a TensorBox in inductor)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def get_size(self) -> list[int]:
        return list(self.tensor.shape)


def verdicts(graph_module: torch.fx.GraphModule, aux: list[Any]) -> Verdict:
    """torch's analyses of one mask graph; ``aux`` are its captured buffers (tensors, or
    inductor's own buffers inside a lowering)."""
    buffers = [_Shape(a) if isinstance(a, Tensor) else a for a in aux]
    context: Any = contextlib.nullcontext()
    if V.graph is None or type(V.graph).__name__ == "NullHandler":
        context = V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator()))  # type: ignore[arg-type]
    with context:
        found = select_packed_mask_intervals(graph_module)
        vec = select_mask_mod_vec_size(
            has_mask_mod=True,
            has_mask_aux_tensors=bool(buffers),
            supports_mask_mod_vec=True,
            graph_module=graph_module,
            other_buffers=buffers,
        )
    return Verdict(
        None if found is None else len(found),
        vec,
        is_trivial_mask_graph(graph_module),
        graph_module.code,
    )


def _tensor_slots(obj: Any, seen: list) -> None:
    """Every (holder, slot, position-in-tuple or None) of a tensor the mask_mod holds."""
    names = [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, Tensor):
            seen.append((obj, name, None))
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if isinstance(item, Tensor):
                    seen.append((obj, name, i))
                elif callable(item):
                    _tensor_slots(item, seen)
        elif callable(value) and hasattr(type(value), "__slots__"):
            _tensor_slots(value, seen)


def traced(mask_mod: Any) -> tuple[torch.fx.GraphModule, list[Tensor]]:
    """The mask graph torch's flex_attention traces for inductor, with the mask_mod's
    tensors as placeholders after ``b, h, q_idx, kv_idx``, and those tensors."""
    mod = copy.deepcopy(mask_mod)
    slots: list = []
    _tensor_slots(mod, slots)
    tensors = [getattr(o, n) if i is None else getattr(o, n)[i] for o, n, i in slots]

    def with_aux(b, h, q_idx, kv_idx, *aux):
        for (holder, name, i), value in zip(slots, aux, strict=True):
            if i is None:
                object.__setattr__(holder, name, value)
            else:
                items = list(getattr(holder, name))
                items[i] = value
                object.__setattr__(holder, name, tuple(items))
        return mod(b, h, q_idx, kv_idx)

    indices = [torch.zeros((), dtype=torch.int) for _ in range(4)]  # distinct: four inputs
    with TransformGetItemToIndex():
        graph = make_fx(with_aux)(*indices, *tensors)
    return graph, tensors


def verdict_of(mask_mod: Any) -> Verdict:
    graph, tensors = traced(mask_mod)
    return verdicts(graph, tensors)


@contextlib.contextmanager
def compiled_graphs() -> Iterator[list[Verdict]]:
    """While open, every flex_attention inductor lowers appends torch's verdicts on its mask
    graph (asked inside the lowering, as FLASH asks them). The FX graph cache is off, so a
    graph cached by an earlier process is lowered again."""
    from torch._inductor import lowering

    seen: list[Verdict] = []
    original = lowering.lowerings[flex_hop]

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(verdicts(args[4][-1].graph_module, list(args[8])))
        return original(*args, **kwargs)

    # Read at import as TORCHINDUCTOR_FX_GRAPH_CACHE: patched here, for this process.
    caches_off = torch._inductor.config.patch(fx_graph_cache=False)
    autograd_off = torch._functorch.config.patch(enable_autograd_cache=False)
    lowering.lowerings[flex_hop] = spy
    try:
        with caches_off, autograd_off:
            yield seen
    finally:
        lowering.lowerings[flex_hop] = original
