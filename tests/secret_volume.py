"""A folder laid out as the kubelet mounts a Secret, for the TLS reload tests: each update is
a new `..<timestamp>/` folder holding the files, `..data` renamed over to point at it (one
atomic swap), the previous folder removed, and each key a symlink `<key> -> ..data/<key>`."""

from __future__ import annotations

import os
from pathlib import Path


class MountedSecret:
    def __init__(self, root: Path) -> None:
        root.mkdir(exist_ok=True)
        self.root = root
        self._generation = 0
        self._current: Path | None = None

    def path(self, name: str) -> str:
        return str(self.root / name)

    def publish(self, files: dict[str, bytes]) -> None:
        """The kubelet's update: new folder, `..data` renamed over, old folder gone."""
        fresh = self._write(files)
        staged = self.root / "..data_tmp"
        staged.symlink_to(fresh.name)
        os.replace(staged, self.root / "..data")
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
        if self._current is not None:
            for old in self._current.iterdir():
                old.unlink()
            self._current.rmdir()
        self._current = fresh

    def _write(self, files: dict[str, bytes]) -> Path:
        self._generation += 1
        folder = self.root / f"..2026_01_01_00_00_{self._generation:02d}.{os.getpid()}"
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return folder
