"""The Dockerfile's shape (no Docker engine runs here): it builds the wheels the way
`make dist` does and installs the pdproc wheel, never the source tree, and the default
(last) stage holds pdproc without the simulator."""

from __future__ import annotations

import re
import tomllib

from .conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
DOCKERIGNORE = (REPO / ".dockerignore").read_text().split()


def stages() -> list[tuple[str, str]]:
    """(stage name or "", its instructions) in order."""
    parts = re.split(r"(?m)^FROM\s+", DOCKERFILE)[1:]
    found = []
    for part in parts:
        header, _, body = part.partition("\n")
        name = header.split(" AS ")[1].strip() if " AS " in header else ""
        found.append((name, body))
    return found


def instructions(text: str) -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(i.split()) for i in "\n".join(lines).replace("\\\n", " ").splitlines() if i]


def test_wheels_are_built_like_make_dist_and_installed_as_wheels() -> None:
    runs = [i for _, body in stages() for i in instructions(body) if i.startswith("RUN ")]
    assert any("python -m build --outdir /dist ." in i for i in runs)
    installs = [i for i in runs if "pip install" in i]
    assert any('"$(ls /dist/pdproc-*.whl)"' in i for i in installs), installs
    for install in installs:
        assert not re.search(r"pip install\s+(-e\s+)?[\"']?\.(\[|\s|$|[\"'])", install), install
        assert "--force-reinstall" not in install, install


def test_the_default_stage_is_pdproc_without_the_simulator() -> None:
    name, body = stages()[-1]
    assert name == ""
    assert "COPY --from=venv /opt/pdproc /opt/pdproc" in body
    sim_venv = dict(stages())["sim-venv"]
    assert "pdproc_sim-" in sim_venv
    assert "pdproc_sim" not in dict(stages())["venv"]
    base = dict(stages())["runtime-base"]
    assert re.search(r"(?m)^USER\s+10001", base)
    assert 'ENTRYPOINT ["pdproc"]' in base


def test_the_build_context_has_what_the_sdists_need() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = ["pyproject.toml", project["readme"], *project["license-files"], "pdproc/"]
    needed += ["sim/pyproject.toml", "sim/README.md", "sim/pdproc_sim/"]
    for path in needed:
        assert f"!{path}" in DOCKERIGNORE, f".dockerignore keeps {path} out of the context"
    copies = [i.split()[1:-1] for i in instructions(DOCKERFILE) if i.startswith("COPY ")]
    for sources in copies:
        for source in sources:
            if source.startswith("--from="):
                break
            assert (REPO / source).exists(), source
            kept = source.rstrip("/")
            assert any(
                e in (f"!{kept}", f"!{kept}/") or e.startswith(f"!{kept}/") for e in DOCKERIGNORE
            ), f"COPY {source}: not in the build context (.dockerignore)"
