"""What the ranks of a context-parallel call agree on before any key or value moves: one
all-gather of a fixed-size int64 status per rank, read alike on every rank.

A rank's status says whether its inputs passed its own checks, then everything that decides
its result and must be the same on every rank: (dims, B, H, S, D, dtype) of query, key and
value; its shard's BlockMask shape, lengths and block size; the arguments and the mask the
shard was made from (the mask as a fingerprint of its content key: pieces and data); the
balancer's permutation (a fingerprint); the path (exchange or all-gather); and on the
exchange path the split sizes it sends and receives. Every rank reads the same table, so
where one field differs every rank raises the same ValueError, naming the first such field
and each rank's value — before gloo would abort on unequal sizes or, worse, attend with
tensors that disagree.

What it cannot see: a plain BlockMask shard carries no mask nor permutation (those fields
are unknown there, and compared only among the ranks that know them); ``score_mod``,
``scale`` and the other keywords passed to ``flex_attention``; the values in the tensors.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import cachetools
import torch
import torch.distributed as dist
from torch import Tensor

from flexmask._validate import digest
from flexmask.context_parallel.lazy import LazyShard
from flexmask.context_parallel.rank_shard import CPShard

if TYPE_CHECKING:
    from flexmask.context_parallel.exchange_plan import KVExchange

UNKNOWN = -(2**63)
"""A status entry this rank cannot know (a plain BlockMask has no mask nor permutation to
fingerprint): compared only among the ranks that know theirs."""


class Field(NamedTuple):
    """One status entry: its name in the error, and what every rank must do about it."""

    name: str
    fix: str


_TENSORS_FIX = (
    "every rank must pass query, key and value of one shape (B, H, S / W, D) and one dtype "
    "each: their slices of the same global tensors (shard.shard_tensor / shard_kv)"
)
_SHARD_FIX = (
    "every rank must pass its shard of one sharding: the same B, H, Q_LEN, KV_LEN and "
    "BLOCK_SIZE in flexmask.shard / plan_exchange / lazy_shard"
)
FIELDS: tuple[Field, ...] = (
    Field("passed", "a rank refused its inputs"),
    *(
        Field(f"{tensor}.{part}", _TENSORS_FIX)
        for tensor in ("query", "key", "value")
        for part in ("dims", "B", "H", "S", "D", "dtype")
    ),
    Field("block_mask.B", _SHARD_FIX),
    Field("block_mask.H", _SHARD_FIX),
    Field("block_mask.Q_LEN (queries per rank)", _SHARD_FIX),
    Field("block_mask.KV_LEN", _SHARD_FIX),
    Field("BLOCK_SIZE (query side)", _SHARD_FIX),
    Field("BLOCK_SIZE (key side)", _SHARD_FIX),
    Field("shard's B argument (0: None)", _SHARD_FIX),
    Field("shard's H argument (0: None)", _SHARD_FIX),
    Field("shard's Q_LEN", _SHARD_FIX),
    Field(
        "mask",
        "every rank must shard the same mask: the same pieces and the same data (document "
        "lengths, tree, positions), made from the same batch",
    ),
    Field(
        "balancer",
        "every rank must shard with the same balancer and so the same permutation (the "
        "same balancer argument, or a _LoadBalancer made from the same data)",
    ),
    Field(
        "exchange (1: needed keys only, 0: all-gather)",
        "every rank must take the same path: the same exchange= and the same kind of shard "
        "(a KVExchange or lazy shard exchanges under 'needed' or its own 'auto' choice; a "
        "CPShard or BlockMask all-gathers)",
    ),
)
# Shown by dtype name, and in hex.
_DTYPES = {field.name for field in FIELDS if field.name.endswith(".dtype")}
_FINGERPRINTS = {"mask", "balancer"}


def status_size(world: int) -> int:
    """Entries of a rank's status: one per field, then ``world`` split sizes sent and
    ``world`` received. Fixed by the world size alone (gloo aborts on unequal sizes)."""
    return len(FIELDS) + 2 * world


# --------------------------------------------------------------------------- fingerprints
def _encode(obj: Any, out: list[bytes]) -> None:
    """Bytes of ``obj`` that every process computes alike: Python's ``hash`` of a string
    differs per process (PYTHONHASHSEED), a set iterates in hash order, and an object's
    default repr holds its address."""
    kind = type(obj)
    if obj is None or kind in (bool, int, float, complex, str):
        out.append(f"{kind.__name__}:{obj!r};".encode())
    elif kind is tuple and all(type(v) in (bool, int, float, str) for v in obj):
        # The common key (lengths, offsets, digests): one repr, the same in every process.
        out.append(f"tuple:{obj!r};".encode())
    elif isinstance(obj, (tuple, list)):
        out.append(f"{kind.__name__}[{len(obj)}".encode())
        for item in obj:
            _encode(item, out)
        out.append(b"]")
    elif isinstance(obj, (set, frozenset, dict)):
        items = obj.items() if isinstance(obj, dict) else ((v, None) for v in obj)
        encoded = sorted(_bytes(k) + b"=" + _bytes(v) for k, v in items)
        out.append(f"{kind.__name__}{{{len(encoded)}".encode())
        out.extend(encoded)
        out.append(b"}")
    elif isinstance(obj, (bytes, bytearray)):
        out.append(b"bytes:%d:" % len(obj) + bytes(obj))
    elif isinstance(obj, Tensor):
        # The shared content digest (dtype, shape, bytes read in place): numpy is no
        # dependency of flexmask, and a wheel's environment may lack it.
        out.append(f"tensor:{digest(obj)};".encode())
    elif isinstance(obj, (torch.dtype, torch.device)):
        out.append(f"{kind.__name__}:{obj};".encode())
    elif isinstance(obj, enum.Enum):
        out.append(f"enum:{kind.__module__}.{kind.__qualname__}.{obj.name};".encode())
    else:
        # An object with its own repr is read by it (ints, numpy scalars, dataclasses); one
        # with object's default repr only by its type: that repr holds its address.
        shown = "" if kind.__repr__ is object.__repr__ else repr(obj)
        out.append(f"object:{kind.__module__}.{kind.__qualname__}:{shown};".encode())


def _bytes(obj: Any) -> bytes:
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def fingerprint(obj: Any) -> int:
    """A signed 64-bit fingerprint of a content key (or a tensor), the same in every
    process: the first 8 bytes of its SHA-256 over a canonical encoding. Never ``UNKNOWN``.

    Example:
        >>> import flexmask
        >>> a = flexmask.causal() & flexmask.document([4, 12])
        >>> fingerprint(a.key) == fingerprint((flexmask.document([4, 12]) & flexmask.causal()).key)
        True
        >>> fingerprint(a.key) == fingerprint((flexmask.causal() & flexmask.document([8, 8])).key)
        False
    """
    value = int.from_bytes(hashlib.sha256(_bytes(obj)).digest()[:8], "little", signed=True)
    return value + 1 if value == UNKNOWN else value


# A shard's fingerprints by its content key (a layer's calls reuse one shard): its mask's
# key may hold a long tuple of lengths and its permutation S positions, read once.
_SHARD_FINGERPRINTS: cachetools.LRUCache = cachetools.LRUCache(maxsize=16)
_LOCK = threading.Lock()


def _shard_entries(shard: Any) -> list[int]:
    """The shard's B, H and Q_LEN arguments, its mask's and its permutation's fingerprints;
    UNKNOWN for each where ``shard`` is a plain BlockMask."""
    if isinstance(shard, LazyShard):
        shard = shard.shard
    if not isinstance(shard, CPShard):
        return [UNKNOWN] * 5
    key = shard.key  # ("cp_shard", world, rank, balancer, B, H, Q_LEN, ..., mask key)
    ours = isinstance(key, tuple) and len(key) == 11 and key[0] == "cp_shard"
    with _LOCK:
        found = _SHARD_FINGERPRINTS.get(key)
    if found is None:
        # A CPShard made by hand with another key still shows its permutation.
        mask = fingerprint(key[-1]) if ours else UNKNOWN
        found = (mask, fingerprint(shard.indices))
        with _LOCK:
            _SHARD_FINGERPRINTS[key] = found
    batch, heads, q_len = key[4:7] if ours else (UNKNOWN,) * 3
    return [batch or 0, heads or 0, q_len, *found]


def _tensor_entries(tensor: Any) -> list[int]:
    """(dims, B, H, S, D, dtype id) of a (..., H, S, D) tensor; B is the product of the dims
    before H."""
    if not isinstance(tensor, Tensor):
        return [UNKNOWN] * 6
    shape = tuple(tensor.shape) + (1,) * max(0, 3 - tensor.dim())
    batch = 1
    for size in shape[:-3]:
        batch *= size
    # A dtype by a number every process computes alike (str hashes differ per process).
    return [tensor.dim(), batch, *shape[-3:], zlib.crc32(str(tensor.dtype).encode())]


def status(
    query: Any, key: Any, value: Any, shard: Any, plan: KVExchange | None, world: int
) -> list[int]:
    """This rank's status (``status_size(world)`` ints) for inputs that passed its checks:
    ``shard`` is the shard every key is ordered by (a CPShard, LazyShard or BlockMask),
    ``plan`` the exchange plan, None on the all-gather path."""
    block_mask = shard.block_mask if isinstance(shard, (CPShard, LazyShard)) else shard
    q_len, kv_len = block_mask.seq_lengths
    entries = [1]
    for tensor in (query, key, value):
        entries += _tensor_entries(tensor)
    entries += [*block_mask.shape[:2], q_len, kv_len, *block_mask.BLOCK_SIZE]
    entries += _shard_entries(shard)
    entries.append(int(plan is not None))
    if plan is not None:
        entries += [*plan.send_counts, *plan.recv_counts]
    else:
        entries += [0] * (2 * world)
    return [int(e) for e in entries]


# ------------------------------------------------------------------------------ the table
def agree(
    query: Any,
    key: Any,
    value: Any,
    shard: Any,
    plan: KVExchange | None,
    refused: bool,
    group: Any,
    world: int,
) -> None:
    """One all-gather of every rank's status, before the all-gather or exchange of keys and
    values; then every rank reads the same table. Where a rank refused its inputs, every
    rank raises — this one (``refused``) returns so its caller raises its own error, the
    others a ValueError naming it; where a field differs, every rank raises a ValueError
    naming the first one and every rank's value. Returns where all ranks agree."""
    entries = [0] * status_size(world) if refused else status(query, key, value, shard, plan, world)
    device = next(
        (t.device for t in (key, query, value) if isinstance(t, Tensor)), torch.device("cpu")
    )
    mine = torch.tensor(entries, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    if refused:
        return  # the caller raises this rank's own error
    rows = torch.stack(table).cpu()
    failed = (rows[:, 0] == 0).nonzero().flatten().tolist()
    if failed:
        raise ValueError(
            f"rank(s) {failed} of the group refused their inputs before the keys and values "
            "moved (their own errors name the argument); every rank stops here instead of "
            "waiting in the collective for them"
        )
    for index, field in enumerate(FIELDS):
        column = rows[:, index].tolist()
        known = [v for v in column if v != UNKNOWN]
        if len(set(known)) > 1:
            raise ValueError(_disagreement(field, column, shard))
    if plan is None:
        return
    sends, receives = rows[:, len(FIELDS) : len(FIELDS) + world], rows[:, len(FIELDS) + world :]
    if not torch.equal(sends, receives.T):
        raise ValueError(
            "the ranks' exchange plans disagree (what one sends another is not what that one "
            f"expects; each rank's sends: {sends.tolist()}, receives: {receives.tolist()}): "
            "every rank must plan from the same mask, shape, balancer and BLOCK_SIZE"
        )


def _shown(field: Field, value: int, own: dict[int, str]) -> str:
    if value == UNKNOWN:
        return "? (a plain BlockMask shard)"
    if field.name in _DTYPES:
        return own.get(value, f"dtype id {value}")
    if field.name in _FINGERPRINTS:
        return f"{value & (2**64 - 1):#018x}"
    return str(value)


def _disagreement(field: Field, column: list[int], shard: Any) -> str:
    # dtype ids back to names: torch's floating and integer dtypes cover what flex takes.
    names = {
        zlib.crc32(str(d).encode()): str(d)
        for d in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.int8,
            torch.int32,
            torch.int64,
        )
    }
    per_rank = ", ".join(f"rank {r}: {_shown(field, v, names)}" for r, v in enumerate(column))
    message = (
        f"the ranks disagree on {field.name} before the keys and values move ({per_rank}): "
        f"{field.fix}. Every rank raises this error; nothing was exchanged"
    )
    if field.name == "mask" and isinstance(shard, (CPShard, LazyShard)):
        # The others' masks are only fingerprints here; this rank's content key says which
        # pieces and data it holds, to compare with what the other ranks print.
        shown = repr(shard.key[-1])
        message += f". This rank's mask key: {shown[:300]}{'...' if len(shown) > 300 else ''}"
    return message
