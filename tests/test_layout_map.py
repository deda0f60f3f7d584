"""docs/design.md's layout map names every module that exists, in its room.

The map is where a newcomer learns the house; a module it leaves out is one nobody finds.
Each entry of the map (``    ckpt/storage/  ...``) must name, as a word, every module file
of that folder.
"""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"__init__", "__main__"}


def layout_entries() -> dict[str, str]:
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = text.split("## Repository layout and dependency direction", 1)[1]
    block = block.split("Dependency direction", 1)[0]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"^    ([a-z_]+(?:/[a-z_]+)*/)\s", line)
        if match:
            current = match.group(1)
            entries[current] = line[match.end() :]
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_every_module_is_named_in_its_room_of_the_layout_map():
    entries = layout_entries()
    assert {"ckpt/", "ckpt/storage/", "elastic/", "runcore/", "warmstart/", "trainer/"} <= set(
        entries
    )
    missing = []
    for folder, words in entries.items():
        path = os.path.join(REPO, folder)
        if not os.path.isdir(path) or folder in ("tests/", "bench/"):
            continue
        for name in sorted(os.listdir(path)):
            stem, ext = os.path.splitext(name)
            if ext != ".py" or stem in SKIP:
                continue
            if not re.search(rf"(?<![\w/]){re.escape(stem)}(?!\w)", words):
                missing.append(f"{folder}{name}")
    assert missing == [], f"docs/design.md's layout map does not name: {missing}"


def test_every_room_of_the_packages_has_an_entry():
    entries = layout_entries()
    for package in ("ckpt", "elastic", "runcore", "warmstart", "trainer"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, package)):
            dirnames[:] = [d for d in dirnames if not d.startswith("__") and d != "configs"]
            if any(f.endswith(".py") and f[:-3] not in SKIP for f in filenames):
                folder = os.path.relpath(dirpath, REPO) + "/"
                assert folder in entries, f"docs/design.md's layout map has no entry {folder}"


def test_the_manager_stays_a_coordinator():
    # The manager holds the tier list, the save decisions and the public calls; what it
    # says, how options resolve and how tiers are built live in their own modules. A
    # manager past 400 lines has grown a mechanism that belongs in a room of its own.
    with open(os.path.join(REPO, "ckpt", "manager.py"), encoding="utf-8") as fh:
        lines = fh.read().count("\n")
    assert lines <= 400, f"ckpt/manager.py is {lines} lines"
