"""What the children of a composite must share: their per-row count and their device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def common_rows(children: Sequence[Any]) -> int | None:
    """The shared per-row count of children, or a ValueError if two disagree."""
    rows = None
    for child in children:
        if child.rows is None:
            continue
        if rows is not None and child.rows != rows:
            raise ValueError(
                f"cannot combine masks given for {rows} and {child.rows} batch rows: "
                f"per-row data must have one entry per row of the same batch"
            )
        rows = child.rows
    return rows


def common_device(children: Sequence[Any]) -> torch.device | None:
    device = None
    for child in children:
        if child.device is None:
            continue
        if device is not None and child.device != device:
            raise ValueError(
                f"cannot combine masks made from tensors on {device} and {child.device}: "
                f"move the inputs to one device"
            )
        device = child.device
    return device
