"""What converting a plain PyTorch script to the fault-tolerant API changes, kept as a patch.

``examples/conversions/NAME.patch`` is a unified diff from the plain script (PyTorch,
no checkpoints) to ``examples/NAME.py``, module docstrings aside: the README quotes its
size and ``tests/test_adoption_diffs.py`` checks that it still applies to the example
(reversed, it gives the plain script back). Keeping the patch instead of the plain
script keeps one copy of the code both share.

    python -m testing.conversions plain examples/hf_llama_epochs.py > /tmp/plain.py
    python -m testing.conversions patch /tmp/plain.py examples/hf_llama_epochs.py \\
        > examples/conversions/hf_llama_epochs.patch

the first writes the plain script (the example with its patch reversed), the second
the patch between two scripts.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def split_docstring(text: str) -> tuple[list[str], list[str]]:
    """(the module docstring's lines, the lines after it) of a script."""
    lines = text.splitlines()
    end = ast.parse(text).body[0].end_lineno
    return lines[:end], lines[end:]


def patch_path(example: str) -> str:
    name = os.path.splitext(os.path.basename(example))[0]
    return os.path.join(REPO, "examples", "conversions", f"{name}.patch")


def make_patch(plain_code: list[str], converted_code: list[str], name: str) -> str:
    diff = difflib.unified_diff(plain_code, converted_code, f"plain/{name}", name, lineterm="", n=3)
    return "\n".join(diff) + "\n"


def reverse_apply(patch: str, converted_code: list[str]) -> list[str]:
    """The plain code: ``converted_code`` with ``patch`` reversed, every context line checked.

    Raises ``ValueError`` naming the first hunk that does not match the example.
    """
    plain: list[str] = []
    at = 0  # next converted line (0-based) not yet copied
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        match = _HUNK.match(lines[i])
        i += 1
        if match is None:
            continue
        start = int(match.group(3)) - (0 if match.group(4) == "0" else 1)
        plain.extend(converted_code[at:start])
        at = start
        while i < len(lines) and not lines[i].startswith("@@"):
            kind, text = lines[i][:1], lines[i][1:]
            if kind in (" ", "+"):
                if at >= len(converted_code) or converted_code[at] != text:
                    raise ValueError(f"hunk {match.group(0)}: line {at + 1} of the example differs")
                at += 1
            if kind in (" ", "-"):
                plain.append(text)
            i += 1
    plain.extend(converted_code[at:])
    return plain


def counts(patch: str) -> tuple[int, int]:
    """(lines added, lines removed) of a unified diff."""
    lines = patch.splitlines()
    added = sum(1 for li in lines if li.startswith("+") and not li.startswith("+++"))
    removed = sum(1 for li in lines if li.startswith("-") and not li.startswith("---"))
    return added, removed


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def main(argv: list[str]) -> int:
    if argv[:1] == ["plain"] and len(argv) == 2:
        _, code = split_docstring(_read(argv[1]))
        print(f'"""The plain form of {argv[1]} (python -m testing.conversions)."""')
        print("\n".join(reverse_apply(_read(patch_path(argv[1])), code)))
        return 0
    if argv[:1] == ["patch"] and len(argv) == 3:
        _, plain = split_docstring(_read(argv[1]))
        _, converted = split_docstring(_read(argv[2]))
        sys.stdout.write(make_patch(plain, converted, os.path.basename(argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
