"""The Dockerfile's shape (`make test-compose` builds and runs it; the suite has no Docker
engine): it builds the wheels the way `make dist` does, or takes them from a wheelhouse and
then never asks an index, installs the pdproc wheel, never the source tree, and the default
(last) stage holds pdproc without the simulator. The Kubernetes base runs the image
`make image` tags."""

from __future__ import annotations

import re
import tomllib

from .conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
DOCKERIGNORE = (REPO / ".dockerignore").read_text().split()
ARGS = dict(re.findall(r"(?m)^ARG (\w+)=(\S+)", DOCKERFILE))


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
    assert any("python -m build --outdir /dist sim" in i for i in runs)
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
            source = re.sub(r"\$\{(\w+)\}", lambda m: ARGS[m.group(1)], source)
            assert (REPO / source).exists(), source
            kept = source.rstrip("/")
            assert any(
                e in (f"!{kept}", f"!{kept}/") or e.startswith(f"!{kept}/") for e in DOCKERIGNORE
            ), f"COPY {source}: not in the build context (.dockerignore)"


def test_a_wheelhouse_build_never_asks_an_index() -> None:
    """With wheels in the wheelhouse, every pip install of the image is --no-index; the
    default wheelhouse is an empty folder of the build context (so the default build, from
    PyPI, needs no argument)."""
    assert_default_wheelhouse_empty_and_in_the_context()
    installs = pip_installs()
    assert len(installs) == 2, installs  # pdproc, then pdproc-sim
    for install in installs:
        assert "if ls /wheelhouse/*.whl >/dev/null 2>&1; then set -- --no-index; fi" in install
        assert 'pip install "$@" --find-links /wheelhouse' in install


def assert_default_wheelhouse_empty_and_in_the_context() -> None:
    default = REPO / ARGS["WHEELHOUSE"]
    assert default.is_dir()
    assert not list(default.glob("*.whl"))
    assert f"!{ARGS['WHEELHOUSE']}/" in DOCKERIGNORE
    assert "!build/wheelhouse/" in DOCKERIGNORE  # where `make image` puts it


def pip_installs() -> list[str]:
    """The RUN instructions of every stage that install into the image's virtualenv."""
    runs = [i for _, body in stages() for i in instructions(body) if i.startswith("RUN ")]
    return [i for i in runs if "/opt/pdproc/bin/pip install" in i]


def test_kubernetes_runs_the_image_make_image_tags() -> None:
    makefile = (REPO / "Makefile").read_text()
    image = re.search(r"(?m)^IMAGE \?= (\S+)$", makefile)
    assert image is not None
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    tag = image.group(1).replace("$(VERSION)", version)
    deployment = (REPO / "deploy/kubernetes/base/deployment.yaml").read_text()
    assert re.findall(r"(?m)^\s+image: (\S+)$", deployment) == [tag]
