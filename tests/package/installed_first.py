"""Copied into .venv-test's site-packages by `make test-venv` (with a .pth that imports it):
in every Python process of the test virtualenv, `pdproc` and `pdproc_sim` are imported from
that site-packages and nowhere else. A subprocess a test starts with its working directory at
the checkout (`python -m bench.run`) would otherwise put the checkout's pdproc/ first on
sys.path; if the installed package is missing, the import fails instead of finding the
checkout's copy."""

from __future__ import annotations

import importlib.machinery
import sys
import sysconfig
from collections.abc import Sequence
from types import ModuleType

SITE = sysconfig.get_paths()["purelib"]
PACKAGES = frozenset({"pdproc", "pdproc_sim"})


class InstalledFirst:
    """A meta path finder for the top-level packages under test."""

    @classmethod
    def find_spec(
        cls,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, [SITE])
        if spec is None:
            raise ModuleNotFoundError(f"{fullname} is not installed in {SITE}", name=fullname)
        return spec


if InstalledFirst not in sys.meta_path:
    sys.meta_path.insert(0, InstalledFirst)
