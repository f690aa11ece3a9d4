"""The id a request is known by in pdproc's logs, spans and prefill leg (pure).

`x-request-id` is client input (Envoy keeps a client's value unless told otherwise): it can be
50 KB long or carry quotes and line breaks meant to forge log fields. A plain token of at most
`MAX_CHARS` characters is kept, so an operator can follow a request from the client through
Envoy's access log to pdproc's; anything else is replaced by an id pdproc mints, and only a
short escaped excerpt of the client's value is ever logged.
"""

from __future__ import annotations

import re
import uuid

MAX_CHARS = 128
# Tokens as request ids are written (UUIDs, ULIDs, base64, "trace:span", paths of ids ...).
_TOKEN = re.compile(rf"[A-Za-z0-9._:@/+=~-]{{1,{MAX_CHARS}}}")


def is_plain(value: str) -> bool:
    return _TOKEN.fullmatch(value) is not None


def new_request_id() -> str:
    return "pdproc-" + uuid.uuid4().hex
