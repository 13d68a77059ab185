"""A griffe extension that adapts flexmask's docstrings to mkdocstrings, without editing them.

flexmask writes Google-style docstrings the way Napoleon and most readers expect them; griffe's
parser is stricter on three points, fixed here at docs-build time only:

* ``Example:`` (singular) opens an examples section (griffe only knows ``Examples:``);
* ``a, b: description`` in an ``Args:`` section documents each of ``a`` and ``b``;
* Sphinx roles (``:class:`X```) become inline code, and a paragraph ending in ``::`` (a reST
  literal block) ends in ``:`` instead, its indented block already being Markdown code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ARGS = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params):\s*$")
_SECTION = re.compile(r"^(\s*)[A-Z][A-Za-z ]*:\s*$")
_GROUPED = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)+)\s*:(.*)$")
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc):`~?([^`]+)`")


def rewrite(text: str) -> str:
    """The docstring with the three adaptations applied."""
    text = re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", text, flags=re.MULTILINE)
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = re.sub(r"(\S)::\s*$", r"\1:", text, flags=re.MULTILINE)
    lines = text.split("\n")
    out: list[str] = []
    args_indent: int | None = None  # indent of the open Args: header, if any
    item_indent: int | None = None  # indent of that section's parameter lines
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if args_indent is not None and line.strip() and indent <= args_indent:
            args_indent = item_indent = None  # the section ended
        header = _ARGS.match(line)
        if header:
            args_indent, item_indent = len(header.group(1)), None
            out.append(line)
            i += 1
            continue
        if args_indent is not None and line.strip() and item_indent is None:
            item_indent = indent
        grouped = _GROUPED.match(line) if indent == item_indent else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        prefix, names, first = grouped.groups()
        body = [first]
        i += 1
        # The description: every following line indented deeper than the item (blank lines
        # included while the description goes on after them).
        while i < len(lines):
            nxt = lines[i]
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            if not nxt.strip():
                rest = next((x for x in lines[i:] if x.strip()), "")
                if len(rest) - len(rest.lstrip()) <= indent:
                    break
            body.append(nxt)
            i += 1
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{prefix}{name}:{body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


class FlexmaskDocstrings(griffe.Extension):
    """Rewrites each docstring once, when griffe loads its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
