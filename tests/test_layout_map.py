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
    for package in ("ckpt", "elastic", "runcore", "warmstart", "trainer", "integrations"):
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


def _room(module: str) -> str | None:
    """``ckpt.saving.commit`` -> ``saving/``; ``ckpt.manager`` -> ``manager.py``."""
    parts = module.split(".")
    if parts[0] != "ckpt" or len(parts) < 2:
        return None
    return parts[1] + ("/" if os.path.isdir(os.path.join(REPO, "ckpt", parts[1])) else ".py")


def test_the_rooms_of_ckpt_stand_on_each_other_without_a_circle():
    """Each room (a folder or a top-level module of ``ckpt``) imports only rooms below it:
    no import, even inside a function, runs back up."""
    import ast

    arrows: dict[str, dict[str, str]] = {}
    for dirpath, _, filenames in os.walk(os.path.join(REPO, "ckpt")):
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
            source = _room(module.removesuffix(".__init__"))
            if source is None:
                continue
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                targets = []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                for target in targets:
                    room = _room(target)
                    if room is not None and room != source:
                        arrows.setdefault(source, {}).setdefault(room, f"{module}:{node.lineno}")

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            room = todo.pop()
            if room == goal:
                return True
            if room not in seen:
                seen.add(room)
                todo.extend(arrows.get(room, {}))
        return False

    back = [
        f"{where} ({source} -> {room}, while {room} reaches {source})"
        for source, targets in sorted(arrows.items())
        for room, where in sorted(targets.items())
        if reaches(room, source)
    ]
    assert "storage/" in arrows["saving/"]  # the walk sees the rooms
    assert back == []
