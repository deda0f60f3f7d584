"""Run test code under a ``sys.addaudithook`` that records what the process touches.

    python tests/security/audited.py LOG CODE

Imports torch and the project first (their start-up is not under test), then installs
the hook and runs ``CODE`` (Python source; it sets ``result`` to anything JSON can
write, printed as the last line of stdout). Every file, directory, spawn and delete
event is appended to ``LOG`` as a JSON line ``[event, path-like args...]``; the tests
then assert that nothing outside the checkpoint root was opened, listed, written or
removed, and that no process or command was started.
"""

from __future__ import annotations

import json
import os
import sys

import torch  # noqa: F401  (imported before the hook: not under test)

import ckpt
import ckpt.cli
import ckpt.interop.export
import ckpt.tiers.memory  # noqa: F401

EVENTS = {
    "open", "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename", "os.replace",
    "shutil.rmtree", "shutil.move", "os.symlink", "os.link", "os.truncate", "os.chmod",
    "os.chown", "os.mkdir", "os.utime",
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.startfile",
    "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen",
}  # fmt: skip
SPAWNS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork"}


def main() -> None:
    log_path, code = sys.argv[1], sys.argv[2]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def hook(event: str, args: tuple) -> None:
        if event not in EVENTS:
            return
        shown = [a if isinstance(a, str) else repr(a) for a in args[:3]]
        os.write(fd, (json.dumps([event, *shown]) + "\n").encode())

    namespace: dict = {"result": None}
    sys.addaudithook(hook)
    exec(compile(code, "<audited>", "exec"), namespace)
    print(json.dumps(namespace["result"]))


if __name__ == "__main__":
    main()
