"""Custom resources: the vendored upstream CRD schemas (deploy/schemas/, written by
deploy/schemas/generate.py) and their CEL rules (x-kubernetes-validations), evaluated as the
API server would: defaults applied first, property names escaped, transition rules (oldSelf)
left out since there is no old object."""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cel
import jsonschema

# CEL identifiers the Kubernetes API server escapes in property names (apiextensions CEL).
CEL_RESERVED = {
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
}


def cel_name(name: str) -> str:
    if name in CEL_RESERVED:
        return f"__{name}__"
    return (
        name.replace("__", "__underscores__")
        .replace(".", "__dot__")
        .replace("-", "__dash__")
        .replace("/", "__slash__")
    )


@dataclass(frozen=True)
class SchemaSet:
    name: str  # e.g. envoy-gateway-v1.6.0
    tag: str
    kinds: frozenset[str]  # "group/version/Kind"


@dataclass
class CrdResult:
    errors: list[str] = field(default_factory=list)
    rules_evaluated: int = 0


def _split(text: str, sep: str) -> list[str]:
    return text.split(sep)


def _lower_ascii(text: str) -> str:
    return text.lower()


class CrdSchemas:
    """Every vendored schema set; an object is checked against each set that has its kind
    (Envoy Gateway objects against v1.6.0 and v1.7.0, Gateway API objects against v1.4.0 and
    v1.4.1, ...)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        lock = json.loads((root / "sources.json").read_text("utf-8"))
        self.sets = [SchemaSet(s["set"], s["tag"], frozenset(s["kinds"])) for s in lock]
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        self._programs: dict[str, Any] = {}
        self._context_functions = {"split": _split, "lowerAscii": _lower_ascii}

    def sets_for(self, api_version: str, kind: str) -> list[SchemaSet]:
        key = f"{api_version}/{kind}"
        return [s for s in self.sets if key in s.kinds]

    def is_crd_group(self, api_version: str) -> bool:
        group = api_version.rpartition("/")[0]
        return ("." in group and not group.endswith(".k8s.io")) or group.endswith(
            (".x-k8s.io", "gateway.networking.k8s.io", "inference.networking.k8s.io")
        )

    def _validator(self, schema_set: SchemaSet, api_version: str, kind: str):  # type: ignore[no-untyped-def]
        key = (schema_set.name, f"{api_version}/{kind}")
        if key not in self._validators:
            group, _, version = api_version.rpartition("/")
            path = self.root / schema_set.name / group / f"{kind.lower()}_{version}.json"
            schema = json.loads(path.read_text("utf-8"))
            self._validators[key] = jsonschema.Draft202012Validator(schema)
        return self._validators[key]

    def check(self, obj: dict[str, Any]) -> CrdResult:
        result = CrdResult()
        api_version, kind = str(obj.get("apiVersion")), str(obj.get("kind"))
        for schema_set in self.sets_for(api_version, kind):
            validator = self._validator(schema_set, api_version, kind)
            errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
            for err in errors:
                result.errors.append(f"[{schema_set.name}] {_fmt_error(err)}")
            if errors:
                continue  # CEL rules assume a structurally valid object
            defaulted = apply_defaults(validator.schema, copy.deepcopy(obj))
            self._cel(validator.schema, defaulted, "", schema_set.name, result)
        return result

    # ---------------------------------------------------------------- CEL

    def _program(self, rule: str) -> Any:
        if rule not in self._programs:
            self._programs[rule] = cel.compile(rule)
        return self._programs[rule]

    def evaluate(self, rule: str, value: Any) -> Any:
        ctx = cel.Context()
        for name, fn in self._context_functions.items():
            ctx.add_function(name, fn)
        ctx.add_variable("self", value)
        return self._program(rule).execute(ctx)

    def _cel(
        self, schema: dict[str, Any], value: Any, path: str, set_name: str, result: CrdResult
    ) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            self._cel_rule(rule, schema, value, path, set_name, result)
        for sub_schema, sub, sub_path in _cel_children(schema, value, path):
            self._cel(sub_schema, sub, sub_path, set_name, result)

    def _cel_rule(
        self,
        rule: dict[str, Any],
        schema: dict[str, Any],
        value: Any,
        path: str,
        set_name: str,
        result: CrdResult,
    ) -> None:
        text = rule["rule"]
        if re.search(r"\boldSelf\b", text):
            return  # a transition rule: only on update
        result.rules_evaluated += 1
        where = (path + rule.get("fieldPath", "") or "(root)").lstrip(".")
        try:
            ok = self.evaluate(text, to_cel(schema, value))
        except Exception as exc:  # the engine's error types are not a public API
            result.errors.append(
                f"[{set_name}] {where}: CEL rule {text!r} failed to evaluate ({str(exc)[:160]})"
            )
            return
        if ok is not True:
            message = self._failure_message(rule, schema, value)
            result.errors.append(f"[{set_name}] {where}: {message}")

    def _failure_message(self, rule: dict[str, Any], schema: dict[str, Any], value: Any) -> str:
        message = str(rule.get("message") or f"failed rule: {rule['rule']}")
        if "messageExpression" in rule:
            # the static message stays if the expression cannot be evaluated
            with contextlib.suppress(Exception):
                message = str(self.evaluate(rule["messageExpression"], to_cel(schema, value)))
        return message


def _cel_children(
    schema: dict[str, Any], value: Any, path: str
) -> Iterator[tuple[dict[str, Any], Any, str]]:
    """The sub-values the schema describes, each with its schema and path."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                yield props[key], sub, f"{path}.{key}"
            elif isinstance(extra, dict):
                yield extra, sub, f"{path}[{key}]"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            yield schema["items"], sub, f"{path}[{i}]"


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """The value as CEL sees it: object properties under their escaped names."""
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for key, sub in value.items():
            if props and key in props:
                out[cel_name(key)] = to_cel(props[key], sub)
            elif isinstance(extra, dict):
                out[key] = to_cel(extra, sub)
            else:
                out[cel_name(key) if props else key] = sub
        return out
    if isinstance(value, list):
        items = schema.get("items")
        return [to_cel(items if isinstance(items, dict) else {}, v) for v in value]
    return value


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in `default`s the way the API server does before validating (in place)."""
    if isinstance(value, dict):
        _property_defaults(schema, value)
        _additional_property_defaults(schema, value)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _property_defaults(schema: dict[str, Any], value: dict[str, Any]) -> None:
    """Each declared property: its default when absent, then its own defaults."""
    for key, sub in (schema.get("properties") or {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = apply_defaults(sub, value[key])


def _additional_property_defaults(schema: dict[str, Any], value: dict[str, Any]) -> None:
    """The defaults inside undeclared keys that additionalProperties describes."""
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for key in list(value):
            if key not in (schema.get("properties") or {}):
                value[key] = apply_defaults(extra, value[key])


def _fmt_error(err: jsonschema.ValidationError) -> str:
    path = ".".join(str(p) for p in err.absolute_path) or "(root)"
    message = err.message
    if err.context:  # anyOf/oneOf: the closest branch's complaint
        best = jsonschema.exceptions.best_match(err.context)
        message = f"{message} [{best.message}]"
    if len(message) > 300:
        message = message[:300] + "..."
    return f"{path}: {message}"
