"""The README's adoption numbers are measured: each loop style's example against its plain form.

``examples/plain/`` holds the step loop and the epoch loop as plain PyTorch scripts; the
fault-tolerant examples are the same scripts converted. The README quotes the lines the
conversion adds and removes (module docstrings aside), and how many of them are only
indentation (the loop moves into a ``with`` block); this recomputes them.
"""

from __future__ import annotations

import ast
import difflib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = {
    "step loop": ("examples/plain/bring_your_own_model.py", "examples/bring_your_own_model.py"),
    "epoch loop": ("examples/plain/hf_llama_epochs.py", "examples/hf_llama_epochs.py"),
}


def _code_lines(path: str) -> list[str]:
    """The file's lines after its module docstring."""
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        text = fh.read()
    docstring = ast.parse(text).body[0]
    return text.splitlines()[docstring.end_lineno :]


def diff_size(before: list[str], after: list[str]) -> tuple[int, int]:
    """(lines added, lines removed) by a line diff."""
    diff = list(difflib.unified_diff(before, after, lineterm="", n=0))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    return added, removed


def measured(style: str) -> dict[str, tuple[int, int]]:
    plain, converted = (_code_lines(p) for p in PAIRS[style])
    strip = [line.strip() for line in plain], [line.strip() for line in converted]
    return {"lines": diff_size(plain, converted), "ignoring indentation": diff_size(*strip)}


@pytest.mark.parametrize("style", sorted(PAIRS))
def test_the_readme_quotes_the_measured_diff_of_each_loop_style(style):
    sizes = measured(style)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    (added, removed), (added_ws, removed_ws) = sizes["lines"], sizes["ignoring indentation"]
    quoted = re.search(rf"{style}[^\n]*?\+(\d+)/-(\d+) lines \(\+(\d+)/-(\d+) ignoring", readme)
    assert quoted is not None, f"the README quotes no diff size for the {style}"
    assert tuple(int(n) for n in quoted.groups()) == (added, removed, added_ws, removed_ws), (
        f"{style}: measured +{added}/-{removed} lines (+{added_ws}/-{removed_ws} ignoring "
        "indentation); update the README"
    )
