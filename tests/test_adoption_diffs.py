"""The README's adoption numbers are measured: each loop style's example against its plain form.

``examples/conversions/NAME.patch`` is the conversion of a plain PyTorch script (the
step loop, the epoch loop) into ``examples/NAME.py``, module docstrings aside
(``testing/conversions.py``). The patch must still apply to the example, every context
line checked, and give back a plain script that parses and uses neither ``ckpt`` nor
``elastic``; the README quotes the lines it adds and removes, and how many of them are
only indentation (the loop moves into a ``with`` block).
"""

from __future__ import annotations

import ast
import difflib
import os
import re

import pytest

from testing.conversions import REPO, counts, patch_path, reverse_apply, split_docstring

STYLES = {
    "step loop": "examples/bring_your_own_model.py",
    "epoch loop": "examples/hf_llama_epochs.py",
}


def _example_and_plain(example: str) -> tuple[list[str], list[str], str]:
    with open(os.path.join(REPO, example), encoding="utf-8") as fh:
        _, converted = split_docstring(fh.read())
    with open(patch_path(example), encoding="utf-8") as fh:
        patch = fh.read()
    return converted, reverse_apply(patch, converted), patch


@pytest.mark.parametrize("style", sorted(STYLES))
def test_each_conversion_patch_applies_to_its_example_and_gives_a_plain_script(style):
    converted, plain, _ = _example_and_plain(STYLES[style])
    tree = ast.parse("\n".join(plain))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"ckpt", "elastic"}, imported
    assert plain != converted


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_readme_quotes_the_measured_diff_of_each_loop_style(style):
    converted, plain, patch = _example_and_plain(STYLES[style])
    added, removed = counts(patch)
    stripped = difflib.unified_diff(
        [li.strip() for li in plain], [li.strip() for li in converted], lineterm="", n=0
    )
    added_ws, removed_ws = counts("\n".join(stripped))
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    quoted = re.search(rf"{style}[^\n]*?\+(\d+)/-(\d+) lines \(\+(\d+)/-(\d+) ignoring", readme)
    assert quoted is not None, f"the README quotes no diff size for the {style}"
    assert tuple(int(n) for n in quoted.groups()) == (added, removed, added_ws, removed_ws), (
        f"{style}: measured +{added}/-{removed} lines (+{added_ws}/-{removed_ws} ignoring "
        "indentation); update the README"
    )
