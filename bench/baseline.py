"""A second pdproc to measure beside this one: `--baseline-pdproc` of `python -m bench.run`.

`python -m bench.baseline REF DIR` builds the wheel of pdproc at git revision REF (from
`git archive`, so the checkout is never touched) and installs it into a fresh virtualenv in
DIR; it prints the `pdproc` to pass, e.g.

    python -m bench.baseline main /tmp/pdproc-main
    python -m bench.run --configs floor,pdproc,pdproc-baseline \\
        --baseline-pdproc /tmp/pdproc-main/venv/bin/pdproc

`--baseline-pdproc` takes that binary, a virtualenv folder or a wheel (installed into a
virtualenv in the run's folder). Either way the baseline runs from its own installation,
never from this checkout.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def venv_with(wheel_or_source: Path, where: Path) -> Path:
    """A fresh virtualenv in `where` with pdproc installed from a wheel or a source tree;
    returns its `pdproc`."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, str(wheel_or_source)], check=True)
    return venv / "bin" / "pdproc"


def build_wheel(ref: str, where: Path) -> Path:
    """pdproc's wheel at git revision `ref`, built from an archive of that revision."""
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", ref],
        check=True,
        capture_output=True,
    ).stdout
    source = where / "source"
    source.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    wheels = where / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
    )
    (wheel,) = wheels.glob("pdproc-*.whl")
    return wheel


def resolve(path: Path, workdir: Path) -> Path:
    """The `pdproc` binary that `--baseline-pdproc PATH` names (see the module's docstring)."""
    if path.is_dir():
        binary = path / "bin" / "pdproc"
        if not binary.exists():
            raise SystemExit(f"--baseline-pdproc: no bin/pdproc in {path}")
        return binary
    if path.suffix == ".whl":
        return venv_with(path, workdir / "baseline")
    if not path.exists():
        raise SystemExit(f"--baseline-pdproc: {path} does not exist")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline", description=__doc__)
    parser.add_argument("ref", help="git revision, e.g. main or a commit")
    parser.add_argument("dir", type=Path, help="where the wheel and the virtualenv go")
    args = parser.parse_args()
    where = args.dir.resolve()
    where.mkdir(parents=True, exist_ok=True)
    print(venv_with(build_wheel(args.ref, where), where))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
