"""Results of a validation run, and the small shared types."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# libyaml's loader when PyYAML was built with it (much faster on rendered output).
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def ok(self, check: str, n: int = 1) -> None:
        self.counts[check] = self.counts.get(check, 0) + n

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{where}: {message}")

    def note(self, message: str) -> None:
        self.notes.append(message)


@dataclass(frozen=True)
class Doc:
    obj: dict[str, Any]
    where: str  # "file.yaml#2 Kind/name" for messages

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str((self.obj.get("metadata") or {}).get("name", ""))

    @property
    def namespace(self) -> str:
        return str((self.obj.get("metadata") or {}).get("namespace", ""))

    @property
    def spec(self) -> dict[str, Any]:
        spec = self.obj.get("spec")
        return spec if isinstance(spec, dict) else {}


def load_docs(path: Path, rel: str) -> Iterator[Doc]:
    for i, obj in enumerate(yaml.load_all(path.read_text("utf-8"), Loader=YAML_LOADER)):
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise ValueError(f"document {i} is not a mapping")
        label = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
        yield Doc(obj, f"{rel}#{i} {label}")
