"""Raw-disk baselines and cache control: ``dd`` writes and reads, dropping the page cache."""

from __future__ import annotations

import os
import subprocess

DD_BLOCK_BYTES = 4 << 20
DROP_CACHES = "/proc/sys/vm/drop_caches"


def dd_write(path: str, nbytes: int) -> int:
    """``dd if=/dev/zero of=path bs=4M count=N conv=fdatasync``; returns the bytes written."""
    count = max(1, round(nbytes / DD_BLOCK_BYTES))
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    return count * DD_BLOCK_BYTES


def dd_read(path: str) -> int:
    """``dd if=path of=/dev/null bs=4M``: a raw sequential read; returns the file size."""
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    return os.path.getsize(path)


def drop_page_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns the method used.

    ``sync; echo 3 > /proc/sys/vm/drop_caches`` where writable (root), else
    ``POSIX_FADV_DONTNEED`` on each file after an fsync (dirty pages cannot be dropped).
    """
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise_dontneed"


def files_under(directory: str) -> list[str]:
    """Every regular file under ``directory``, sorted."""
    out = []
    for base, _dirs, names in os.walk(directory):
        out.extend(os.path.join(base, n) for n in names)
    return sorted(out)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
