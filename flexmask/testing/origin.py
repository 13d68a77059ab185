"""Where a leak starts: the first module whose output already depends on an input the mask
keeps from it, found by replaying the leak test's own leaking passes on every module's
recorded inputs and outputs, outermost first (the model, its blocks, the mixer inside the
first leaking block, and on down while a submodule can be named)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flexmask.testing.report import LeakOrigin

# ---------------------------------------------------------------------- recording the calls


@dataclasses.dataclass
class _Call:
    """One call of one module during a recorded forward."""

    module: nn.Module
    path: str
    number: int  # 1-based, among this module's calls in the forward
    parent: int  # index of the call it ran inside (-1: none)
    inputs: list[_Seen]  # the per-token tensors it was given (B, S, ...)
    output: _Seen | None = None  # the first per-token tensor it returned


@dataclasses.dataclass
class _Seen:
    """A tensor a call took or returned, and its version then: a tensor updated in place
    afterwards no longer holds (nor, under autograd, derives from) what the call saw, and
    is not read. Not a copy: a recorded forward holds no more than autograd does."""

    tensor: Tensor
    version: int

    def get(self) -> Tensor | None:
        return self.tensor if self.tensor._version == self.version else None


class _Recorder:
    """Forward hooks on every module of the model, recording each call in the order calls
    start: which module, inside which call, with which per-token inputs and output."""

    def __init__(self, model: nn.Module, shape: tuple[int, int]) -> None:
        self.model, self.shape = model, shape
        self.paths = {id(m): name for name, m in model.named_modules()}
        self.calls: list[_Call] = []
        self.stack: list[int] = []
        self.counts: dict[int, int] = {}

    def __enter__(self) -> _Recorder:
        self.handles = []
        for module in {id(m): m for m in self.model.modules()}.values():
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def reset(self) -> None:
        self.calls, self.stack, self.counts = [], [], {}

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        number = self.counts.get(id(module), 0) + 1
        self.counts[id(module)] = number
        parent = self.stack[-1] if self.stack else -1
        inputs = [_Seen(t, t._version) for t in _per_token((args, kwargs), self.shape, True)]
        self.stack.append(len(self.calls))
        self.calls.append(_Call(module, self.paths[id(module)], number, parent, inputs))

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        index = self.stack.pop()
        found = _per_token(output, self.shape, everything=False)
        self.calls[index].output = _Seen(found[0], found[0]._version) if found else None


def _per_token(value: Any, shape: tuple[int, int], everything: bool) -> list[Tensor]:
    """The float tensors shaped ``(B, S, ...)`` in a value (tuples, lists, mappings — a
    transformers ModelOutput is one — one level deep): all of them, or the first."""
    found: list[Tensor] = []
    items: list[Any] = [value]
    if isinstance(value, (tuple, list)):
        items = list(value)
    elif isinstance(value, Mapping):
        items = list(value.values())
    for item in items:
        if isinstance(item, (tuple, list)):
            inner: list[Any] = list(item)
        elif isinstance(item, Mapping):
            inner = list(item.values())
        else:
            inner = [item]
        for x in inner:
            if (
                isinstance(x, Tensor)
                and x.is_floating_point()
                and x.dim() >= 2
                and tuple(x.shape[:2]) == shape
            ):
                found.append(x)
                if not everything:
                    return found
    return found


# ---------------------------------------------------------------------- the evidence


class _Evidence:
    """Does a recorded tensor already depend on an input its tokens may not read? The
    leaking passes of the method that found the leak, replayed: ``grad`` backpropagates a
    random projection of the pass's tokens of the tensor to the input embeddings, and any
    nonzero gradient at an input the pass keeps apart is the leak (lazily, call by call, as
    the descent asks); ``perturb`` moves the pass's inputs and asks whether the tensor moved
    at a token none of them may reach (every call at once, one forward per pass)."""

    def __init__(self, probe: Any, passes: list[Tensor], method: str, recorder: _Recorder):
        self.probe, self.passes, self.method = probe, passes, method
        runner = probe.runner
        self.forbidden = [probe.forbidden(source, method) for source in passes]
        recorder.reset()
        runner.grad, runner.shift = method == "grad", None
        runner.forward()
        self.calls, self.leaf = recorder.calls, runner.leaf
        self.checks = 0  # backward passes (grad) or forward passes (perturb) replayed
        self.moved: dict[tuple[int, int], bool] = {}  # (call, -1: output | input) -> leaks
        if method == "perturb":
            self._replay_forward(recorder)

    def output_leaks(self, index: int) -> bool:
        return self._leaks(index, -1)

    def inputs_leak(self, index: int) -> bool:
        return any(self._leaks(index, i) for i in range(len(self.calls[index].inputs)))

    def _seen(self, calls: list[_Call], index: int, which: int) -> Tensor | None:
        call = calls[index]
        seen = call.output if which < 0 else call.inputs[which]
        return seen.get() if seen is not None else None

    def _leaks(self, index: int, which: int) -> bool:
        if self.method == "perturb":
            return self.moved.get((index, which), False)
        tensor = self._seen(self.calls, index, which)
        if tensor is None or not tensor.requires_grad:
            return False  # not read, or no path from the input embeddings at all
        for source, forbidden in zip(self.passes, self.forbidden, strict=True):
            self.checks += 1
            if bool((self._grad(tensor, source).cpu() * forbidden > 0).any()):
                return True
        return False

    def _grad(self, tensor: Tensor, source: Tensor) -> Tensor:
        weight = torch.randn(tensor.shape, generator=self.probe.runner.generator).to(tensor)
        view = (tensor.shape[0], tensor.shape[1]) + (1,) * (tensor.dim() - 2)
        weight = weight * source.to(tensor.device).view(view).to(weight.dtype)
        (grad,) = torch.autograd.grad(
            (tensor * weight).sum(), self.leaf, retain_graph=True, allow_unused=True
        )
        if grad is None:
            return torch.zeros(tensor.shape[:2], dtype=torch.float64)
        return grad.detach().reshape(*grad.shape[:2], -1).double().norm(dim=-1)

    def _replay_forward(self, recorder: _Recorder) -> None:
        """Every pass moved again, every call's tensors compared with the base forward's
        (matched by module and call number), then let go: one forward held at a time."""
        runner = self.probe.runner
        leaf = runner.leaf.detach()
        width = float(leaf.float().std().clamp(min=1e-3))
        for source, forbidden in zip(self.passes, self.forbidden, strict=True):
            noise = torch.randn(leaf.shape, generator=runner.generator) * width
            runner.shift = (noise * source.unsqueeze(-1)).to(leaf.device)
            recorder.reset()
            runner.forward()
            self.checks += 1
            moved = {(id(c.module), c.number): c for c in recorder.calls}
            for index, call in enumerate(self.calls):
                again = moved.get((id(call.module), call.number))
                if again is None:
                    continue  # not called in the moved forward: nothing to compare
                for which in range(-1, len(call.inputs)):
                    if self.moved.get((index, which)) or which >= len(again.inputs):
                        continue
                    change = self._change(
                        self._seen(self.calls, index, which), self._seen([again], 0, which)
                    )
                    if change is not None and bool((change.cpu() * forbidden > 0).any()):
                        self.moved[(index, which)] = True
        runner.shift = None

    def _change(self, base: Tensor | None, moved: Tensor | None) -> Tensor | None:
        if base is None or moved is None or moved.shape != base.shape:
            return None
        base_, moved_ = base.detach().double(), moved.detach().double()
        change = (moved_ - base_).reshape(*base.shape[:2], -1).norm(dim=-1)
        if self.probe.beside_grad:
            # The rule the leak test's own forward passes follow beside a gradient: a few
            # ulps is a kernel summing in another order, not a path.
            ulps = 16 * torch.finfo(base.dtype).eps
            change = change * (change > ulps * base_.reshape(*base.shape[:2], -1).norm(dim=-1))
        return change


# ---------------------------------------------------------------------- the descent


def locate(probe: Any, passes: list[Tensor], method: str) -> LeakOrigin | None:
    """The first module whose output leaks (see :class:`LeakOrigin`), or None when the
    model is no ``nn.Module`` (nothing to hook) or none of its calls was recorded."""
    model = probe.runner.model
    if not isinstance(model, nn.Module) or not passes:
        return None
    with _Recorder(model, probe.runner.shape) as recorder:
        evidence = _Evidence(probe, passes, method, recorder)
    calls = evidence.calls
    roots = [i for i, c in enumerate(calls) if c.module is model and c.parent == -1]
    if not roots:
        return None
    counts: dict[int, int] = {}
    for call in calls:
        counts[id(call.module)] = max(counts.get(id(call.module), 0), call.number)
    current, chain, before = roots[0], [roots[0]], None
    while True:
        children = [i for i, c in enumerate(calls) if c.parent == current]
        first = next((i for i in children if evidence.output_leaks(i)), None)
        if first is None:
            break  # no submodule's output leaks: this module's own code
        if evidence.inputs_leak(first):
            before = calls[first].path  # it was given the leak: it started before it
            break
        chain.append(first)
        current = first
    call = calls[chain[-1]]
    layer, layer_type = _layer_of(model, [calls[i].module for i in chain])
    return LeakOrigin(
        path=call.path,
        kind=type(call.module).__name__,
        layer=layer,
        layer_type=layer_type,
        call=call.number,
        calls=counts[id(call.module)],
        before=before,
        chain=tuple(calls[i].path for i in chain[1:]),
        method=method,
        checks=evidence.checks,
    )


def _layer_of(model: nn.Module, chain: list[nn.Module]) -> tuple[int | None, str | None]:
    """The index of the outermost module of the chain that is an item of a list of layers
    (an ``nn.ModuleList`` or ``nn.Sequential``), and its kind where the model's config names
    one per layer (``layer_types``, or ``layers_block_type``, as long as the list)."""
    for module in chain:
        for container in _lists(model):
            items = list(container)
            if any(item is module for item in items):
                index = next(i for i, item in enumerate(items) if item is module)
                config = getattr(model, "config", None)
                for name in ("layer_types", "layers_block_type"):
                    kinds = getattr(config, name, None)
                    if isinstance(kinds, (list, tuple)) and len(kinds) == len(items):
                        return index, str(kinds[index])
                return index, None
    return None, None


def _lists(model: nn.Module) -> Iterator[nn.ModuleList | nn.Sequential]:
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            yield module
