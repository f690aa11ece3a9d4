"""Copy pdproc's kv guard (pdproc/envoy_config/kv_guard.lua) into the gateway manifests that embed
it (an EnvoyExtensionPolicy `lua[].inline`, an EnvoyFilter `inline_string`).

    python deploy/tools/sync_lua.py          # rewrite the embedded copies
    python deploy/tools/sync_lua.py --check  # exit 1 if one differs (validate.py checks too)

Each embedded copy is a YAML block scalar between two marker comments:

    # BEGIN pdproc/envoy_config/kv_guard.lua (deploy/tools/sync_lua.py; do not edit)
    inline: |
      -- pdproc kv guard ...
    # END pdproc/envoy_config/kv_guard.lua

The manifests cannot reference the file directly: kustomize loads nothing from outside a
kustomization's directory tree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE = "pdproc/envoy_config/kv_guard.lua"
BLOCK = re.compile(
    r"(?P<indent>[ ]*)# BEGIN " + re.escape(SOURCE) + r"[^\n]*\n"
    r"(?P=indent)(?P<key>[A-Za-z_]+): \|\n"
    r"(?P<body>(?:(?P=indent)  [^\n]*\n|\n)*?)"
    r"(?P=indent)# END " + re.escape(SOURCE) + r"\n"
)


def render(text: str, lua: str) -> str:
    def replace(match: re.Match[str]) -> str:
        indent = match.group("indent")
        body = "".join(
            f"{indent}  {line}\n" if line else "\n" for line in lua.rstrip("\n").split("\n")
        )
        return (
            f"{indent}# BEGIN {SOURCE} (deploy/tools/sync_lua.py; do not edit)\n"
            f"{indent}{match.group('key')}: |\n{body}{indent}# END {SOURCE}\n"
        )

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    lua = (args.repo / SOURCE).read_text("utf-8")
    stale = []
    for path in sorted((args.repo / "deploy").rglob("*.yaml")):
        text = path.read_text("utf-8")
        if SOURCE not in text:
            continue
        new = render(text, lua)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, "utf-8")
    for path in stale:
        print(f"{'stale' if args.check else 'updated'}: {path.relative_to(args.repo)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
