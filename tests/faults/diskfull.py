"""A small filesystem a test can fill: a tmpfs mounted for the test (we run as root in CI), with a
loop-mounted ext4 image as the fallback. Skips with the reason when mounting is refused."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def _mount_tmpfs(point: Path, size: str) -> str | None:
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def _mount_loop(point: Path, image: Path, size_mb: int) -> str | None:
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed"
    with open(image, "wb") as f:
        f.truncate(size_mb * 2**20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if r.returncode != 0:
        return r.stderr.strip()
    r = subprocess.run(["mount", "-o", "loop", str(image), str(point)], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


@contextlib.contextmanager
def small_filesystem(base: Path, size_mb: int = 4) -> Iterator[Path]:
    """Mount a `size_mb` filesystem under `base` for the duration; unmount and remove it after."""
    point = base / "smallfs"
    point.mkdir()
    why = _mount_tmpfs(point, f"{size_mb}m")
    if why is not None:
        why_loop = _mount_loop(point, base / "smallfs.img", size_mb)
        if why_loop is not None:
            point.rmdir()
            pytest.skip(f"cannot mount a small filesystem to fill: tmpfs: {why}; loop image: {why_loop}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
        with contextlib.suppress(OSError):
            point.rmdir()
        with contextlib.suppress(OSError):
            (base / "smallfs.img").unlink()


def fill(folder: Path) -> Path:
    """Write a filler file until the filesystem is full (ENOSPC). Returns it; unlink to free."""
    filler = folder / "filler"
    chunk = b"\0" * 65536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    if os.write(fd, chunk[:size]) < size:
                        break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return filler
