"""The documentation runs: every code sample in docs/, every docstring example, the site build.

* Each page's fenced ``python`` blocks are executed, and its ``pycon`` blocks (``>>>`` sessions,
  including every ■/⬚ picture printed by ``mask.show``) are checked with doctest — in page
  order, in one namespace per page. A block right after a ``<!-- skip-test -->`` line is
  skipped: only the transformers guide (run by its own test when transformers is installed) and
  GPU-only samples are marked so.
* Every public module's docstring examples are run with doctest.
* ``mkdocs build --strict`` must succeed without a warning.

Samples run with FLEXMASK_COMPILE=0 (so CPU calls take flexmask's slices backend or
block-sparse path): compiling flex_attention takes 13–20 s on a CPU, and the samples'
results do not depend on it.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import flexmask

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
SKIP_MARK = "<!-- skip-test -->"
FENCE = re.compile(r"^(\s*)```\s*([\w-]*)")
DOCTEST_FLAGS = doctest.ELLIPSIS


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the first code line
    skip: bool


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with their language and skip mark."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.groups()
        previous = lines[i - 1].strip() if i > 0 else ""
        start = i + 1
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            i += 1
        body = [line[len(indent) :] for line in lines[start:i]]
        blocks.append(Block(lang, "\n".join(body) + "\n", start + 1, previous == SKIP_MARK))
        i += 1
    return blocks


INLINE_CODE_LINE = re.compile(r"^\s*`[^`]*`\s*(<br\s*/?>)?\s*$")


def unfenced_code(text: str) -> list[tuple[int, str]]:
    """Lines of code outside any fence: (1-based line, text). Such code renders mangled and
    is never run by these tests.

    Caught: a ``>>>`` prompt; an inline code span followed by ``<br>`` (code pasted line by
    line); two or more lines in a row that are each only an inline code span; an indented
    (4-space) code block after a blank line.
    """
    lines = text.splitlines()
    found: list[tuple[int, str]] = []
    fence: str | None = None
    previous = ""
    for number, line in enumerate(lines, 1):
        if fence is None and (match := FENCE.match(line)):
            fence = match.group(1)
            continue
        if fence is not None:
            if re.match(rf"^{fence}```\s*$", line):
                fence, previous = None, ""
            continue
        code_line = INLINE_CODE_LINE.match(line)
        if (
            line.lstrip().startswith(">>>")
            or (code_line and code_line.group(1))
            or (
                code_line and INLINE_CODE_LINE.match(previous) and line.strip() and previous.strip()
            )
            or (re.match(r"^( {4}|\t)\S", line) and previous.strip() == "")
        ):
            found.append((number, line))
        previous = line
    return found


def run_blocks(blocks: list[Block], path: Path, namespace: dict) -> None:
    parser = doctest.DocTestParser()
    for block in blocks:
        where = f"{path.relative_to(ROOT)}:{block.line}"
        if block.lang == "python":
            exec(compile(block.code, where, "exec"), namespace)  # noqa: S102
        elif block.lang == "pycon":
            test = parser.get_doctest(block.code, namespace, where, str(path), block.line - 1)
            runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
            report: list[str] = []
            runner.run(test, out=report.append, clear_globs=False)
            namespace.update(test.globs)
            if runner.failures:
                pytest.fail(f"doctest failed in {where}:\n" + "".join(report), pytrace=False)


@pytest.fixture()
def docs_env(monkeypatch, tmp_path):
    """Eager kernels, a scratch working directory, and flexmask settings restored after."""
    monkeypatch.setenv("FLEXMASK_COMPILE", "0")
    monkeypatch.chdir(tmp_path)
    flexmask.set_compile(None)
    yield
    flexmask.set_compile(None)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_samples_run(page, docs_env):
    blocks = [b for b in code_blocks(page) if b.lang in ("python", "pycon") and not b.skip]
    run_blocks(blocks, page, {"__name__": f"docs.{page.stem}"})


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_sample_is_fenced(page):
    found = unfenced_code(page.read_text(encoding="utf-8"))
    assert not found, "code outside a ``` fence (it renders mangled and never runs):\n" + "\n".join(
        f"{page.relative_to(ROOT)}:{n}: {line}" for n, line in found
    )


@pytest.mark.parametrize(
    "text, lines",
    [
        ("Prose.\n\n`import torch`<br>\n`x = 1`\n", [3, 4]),  # pasted line by line
        ("Prose.\n\n`import torch`\n`x = torch.zeros(2)`\n", [4]),
        ("Prose.\n>>> import flexmask\n", [2]),
        ("Prose.\n\n    x = 1\n", [3]),
        ("`flexmask.padding(lengths)`\n\nProse with `code` and a<br>\n", []),  # a signature
        ("* item\n\n```python\n>>> 1\n    x = 1\n```\n", []),  # fenced: fine
    ],
)
def test_unfenced_code_is_caught(text, lines):
    assert [n for n, _ in unfenced_code(text)] == lines


def test_only_allowed_blocks_are_skipped():
    skipped = {
        page.relative_to(DOCS).as_posix()
        for page in PAGES
        for block in code_blocks(page)
        if block.skip
    }
    assert skipped <= {"transformers.md", "compile.md"}, skipped
    for page in PAGES:
        for block in code_blocks(page):
            if block.skip and page.name == "compile.md":
                assert "cuda" in block.code, "only GPU samples may be skipped on compile.md"


@pytest.mark.parametrize("page", sorted((DOCS / "pieces").glob("*.md")), ids=lambda p: p.name)
def test_piece_pages_have_a_picture_and_a_png(page):
    text = page.read_text(encoding="utf-8")
    pictures = [b for b in code_blocks(page) if b.lang == "pycon" and ".show(" in b.code]
    assert pictures and all("■" in b.code for b in pictures), "needs a checked ■/⬚ picture"
    images = re.findall(r"!\[.*?\]\(\.\./img/([\w.-]+\.png)\)", text)
    assert images, "needs a PNG made by flexmask.plot (docs/make_images.py)"
    for name in images:
        assert (DOCS / "img" / name).is_file(), f"docs/img/{name} is missing"


def test_every_generated_image_is_used():
    sys.path.insert(0, str(DOCS))
    try:
        make_images = importlib.import_module("make_images")
    finally:
        sys.path.remove(str(DOCS))
    text = "".join(page.read_text(encoding="utf-8") for page in PAGES)
    for name in make_images.images():
        assert f"img/{name}" in text, f"{name} is generated but no page shows it"
        assert (DOCS / "img" / name).is_file(), f"run python docs/make_images.py ({name})"


# ------------------------------------------------------------------------- docstring examples
MODULES = sorted(
    ["flexmask"] + [m.name for m in pkgutil.walk_packages(flexmask.__path__, "flexmask.")]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, docs_env):
    # import_module, not getattr: flexmask.plot and flexmask.lazy are also function names.
    if name == "flexmask.integrations.transformers":
        pytest.importorskip("transformers", reason="its examples build transformers models")
    if name == "flexmask.integrations.torchtitan":
        pytest.importorskip("torchtitan.models.common.attention", reason="needs torchtitan")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    assert not runner.failures, "".join(report)


# ------------------------------------------------------------------------- the site
def test_mkdocs_build_is_strict_and_clean(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


# ------------------------------------------------------------------------- transformers
@pytest.mark.slow
def test_transformers_guide(docs_env):
    pytest.importorskip("transformers")
    page = DOCS / "transformers.md"
    blocks = [b for b in code_blocks(page) if b.lang == "python" and b.skip]
    assert len(blocks) == 4
    run_blocks([Block(b.lang, b.code, b.line, False) for b in blocks], page, {"__name__": "hf"})
