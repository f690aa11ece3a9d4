"""What clients send, for the property tests: hypothesis strategies of bodies and of
`x-prefiller-host-port` values, a JSON writer that spells keys the way an attacker may
(escaped, non-ASCII), and an independent oracle of what pdproc must make of each body.

The oracle does not reuse pdproc's code: it says a body is a 400 when it is not JSON, not an
object, nested deeper than the prefill leg can be re-serialised, carries a top-level
`kv_transfer_params` (however its key is spelled) or an integer outside 64 bits; any other
body must be disaggregated with both legs carrying the client's values exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
from hypothesis import strategies as st

KV = "kv_transfer_params"
# Fields pdproc rewrites on the prefill leg (priming it to one token) or sets itself.
PRIMED = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "min_tokens",
        "best_of",
        "stop",
        "stop_token_ids",
        "n",
        "ignore_eos",
        "max_output_tokens",
        "sampling_params",
        KV,
    }
)
# Top-level fields only the gateway sets (vLLM's and SGLang's KV transfer fields), written
# here independently of pdproc.gateway_fields.
GATEWAY_ONLY = frozenset(
    {
        KV,
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "disagg_prefill_dp_rank",
    }
)
RESERVED = PRIMED | GATEWAY_ONLY | {"model", "messages"}
# Deepest nesting the prefill leg's serialiser (orjson) writes, counting the top object.
MAX_DEPTH = 254
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
EDGE_INTS = [
    INT_MAX,
    INT_MAX + 1,
    INT_MIN,
    INT_MIN - 1,
    2**63 - 1,
    2**63,
    10**19,
    -(10**19),
    10**30,
    -(10**30),
    0,
    -1,
]

# Values any JSON library carries (64-bit integers, finite floats); the edge cases come
# one at a time from EDGES, so that most bodies are ones pdproc must disaggregate.
integers = st.integers(-1000, 1000) | st.integers(INT_MIN, INT_MAX)
floats = st.floats(allow_nan=False, allow_infinity=False)
leaves = st.none() | st.booleans() | integers | floats | st.text(max_size=12)
EDGES = [str(number) for number in EDGE_INTS] + [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1e-400",
    "123456789012345678901234567890.5",
    "-0",
    "-0.0",
    '"12345678901234567890123"',
]
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
# A top-level kv_transfer_params key, in spellings a JSON parser reads as that key, and
# near misses that are other keys (and must be carried, not refused).
KV_KEYS = {
    "plain": '"kv_transfer_params"',
    "one-escape": '"kv_transfer_param\\u0073"',
    "all-escaped": '"' + "".join(f"\\u{ord(c):04x}" for c in KV) + '"',
    "upper-escape": '"kv\\u005Ftransfer_params"',
    "case": '"KV_TRANSFER_PARAMS"',
    "space": '"kv_transfer_params "',
    "nul": '"kv_transfer_params\\u0000"',
    # SGLang's transfer fields: refused whichever connector runs.
    "sglang-host": '"bootstrap_host"',
    "sglang-room-escaped": '"bootstrap_roo\\u006d"',
    "sglang-pair-key": '"bootstrap_pair_key"',
    "sglang-dp-rank": '"disagg_prefill_dp_rank"',
    "sglang-near-miss": '"bootstrap_hosts"',
}
# Wrappers nesting a value n deep ("[" * n or '{"a":' * n).
DEPTHS = [0, 0, 0, 1, 10, 100, 200, 300, 1000, 1024, 1025, 3000]


def write(value: Any, *, ascii_only: bool, escape_keys: bool) -> str:
    """JSON text of `value`; keys spelled with \\u escapes when `escape_keys`."""
    if isinstance(value, dict):
        items = (
            _key(key, ascii_only, escape_keys)
            + ":"
            + write(item, ascii_only=ascii_only, escape_keys=escape_keys)
            for key, item in value.items()
        )
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        parts = (write(item, ascii_only=ascii_only, escape_keys=escape_keys) for item in value)
        return "[" + ",".join(parts) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def _key(key: str, ascii_only: bool, escape_keys: bool) -> str:
    if not escape_keys:
        return json.dumps(key, ensure_ascii=ascii_only)
    return (
        '"'
        + "".join(json.dumps(c)[1:-1] if ord(c) > 0xFFFF else f"\\u{ord(c):04x}" for c in key)
        + '"'
    )


@st.composite
def client_bodies(draw: st.DrawFn, primed_fields: bool = True) -> bytes:
    """A chat request with extra fields of any JSON, sometimes a kv key, deep nesting,
    priming fields (any values, unless `primed_fields` is false: then a valid max_tokens
    only, as a real vLLM pair accepts), escaped keys and JSON whitespace around it."""
    ascii_only = draw(st.booleans())
    escape_keys = draw(st.booleans())
    extras = draw(
        st.dictionaries(
            st.text(max_size=10).filter(lambda key: key not in RESERVED), values, max_size=5
        )
    )
    primed = (
        {"max_tokens": 4}
        if not primed_fields
        else draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "max_tokens": integers | st.sampled_from(EDGE_INTS),
                    "max_completion_tokens": st.integers(1, 100),
                    "stream": st.booleans(),
                    "stream_options": st.just({"include_usage": True}),
                    "min_tokens": st.integers(0, 10),
                    "stop": st.lists(st.text(max_size=3), max_size=2),
                    "n": st.integers(0, 4),
                },
            )
        )
    )
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": draw(st.text())}],
    }
    body.update(primed)
    body.update(extras)
    parts = [write(body, ascii_only=ascii_only, escape_keys=escape_keys)[1:-1]]
    kv = draw(st.sampled_from([None, None, *KV_KEYS]))
    if kv is not None:
        parts.append(KV_KEYS[kv] + ":" + write(draw(values), ascii_only=True, escape_keys=False))
    depth = draw(st.sampled_from(DEPTHS))
    if depth:
        opening, closing = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = "1" if opening != "[" else ""
        parts.append('"deep":' + opening * depth + inner + closing * depth)
    if draw(st.booleans()):
        parts.append('"nested":{"kv_transfer_params":{"do_remote_prefill":true}}')
    if draw(st.integers(0, 3)) == 0:
        edge = draw(st.sampled_from(EDGES))
        parts.append('"edge":' + draw(st.sampled_from([edge, f"[{edge}]", f'{{"x":{edge}}}'])))
    order = draw(st.permutations(parts))
    blank = st.sampled_from(["", " ", "\n", "\r\n\t "])
    text = draw(blank) + "{" + ",".join(order) + "}" + draw(blank)
    return text.encode()


any_bodies = st.one_of(
    client_bodies(),
    client_bodies(),
    values.map(lambda v: write(v, ascii_only=False, escape_keys=False).encode()),
    st.binary(max_size=64),
    st.sampled_from([b"{}", b"{ }", b" {}\n", b"[]", b"null", b'"x"', b'{"a":1e400}']),
)


# Port spellings that are not a port, even after the entry's blanks and trailing slashes
# are stripped: non-ASCII digits, signs, inner blanks, out of range ... (so that no entry
# names 127.0.0.1 at a port other than the pod's: that would be a legitimate 502).
BAD_PORTS = [
    "",
    "0",
    "65536",
    "99999",
    "123456",
    "-1",
    "+80",
    " 80",
    "8 0",
    "1e3",
    "0x50",
    "80\u00b2",
    "\uff18\uff10",
    "8\u0660",
    "\U0001d7d6",
    "80/x",
]
# Hosts that are not the pod: other spellings of loopback (never allowed: only the literal
# 127.0.0.1 is in the allow list), zone ids, IPv6 without brackets, names, junk.
OTHER_HOSTS = [
    "10.0.0.1",
    "localhost",
    "127.1",
    "2130706433",
    "0x7f000001",
    "0177.0.0.1",
    "127.0.0.1.",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "[fe80::1%eth0]",
    "[fe80::1%25eth0]",
    "[::1",
    "::1",
    "\uff11\uff12\uff17.0.0.1",
    "xn--e1afmkfd.xn--p1ai",
    "exa mple",
    "a" * 300,
    "",
]


def header_values(
    pod_port: int, *, longest: int = 60_000, printable: bool = False
) -> st.SearchStrategy[str]:
    """Header values: comma lists of entries naming the pod (only ever at its own port) or
    anything else, long runs, and any text. `printable` keeps to what an HTTP client can
    send (no control characters)."""
    chars = (
        st.characters(exclude_categories=("Cs", "Cc"))
        if printable
        else st.characters(codec="utf-8")  # anything but surrogates
    )
    port = st.sampled_from([str(pod_port), *BAD_PORTS]) | st.text(chars, max_size=6)
    pod_entry = st.builds(
        lambda prefix, port, suffix: f"{prefix}127.0.0.1:{port}{suffix}",
        st.sampled_from(["", "http://", " ", "https://"]),
        st.sampled_from([str(pod_port), *BAD_PORTS]),
        st.sampled_from(["", "/", " ", "/v1"]),
    )
    other_host = st.sampled_from(OTHER_HOSTS) | st.text(chars, max_size=20).filter(
        lambda host: "127.0.0.1" not in host
    )
    other_entry = st.builds(
        lambda host, sep, port: f"{host}{sep}{port}",
        other_host,
        st.sampled_from([":", "", "::", "\uff1a"]),
        port,
    )
    entry = pod_entry | other_entry | st.sampled_from(["", " ", "\t"])
    listed = st.lists(entry, min_size=1, max_size=4).map(",".join)
    runs = ["9", "a", ",", " ", "\u00ff", "["] + ([] if printable else ["\x80"])
    long = st.builds(
        lambda char, count: char * count, st.sampled_from(runs), st.integers(100, longest)
    )
    anything = st.text(chars, max_size=40).filter(lambda text: "127.0.0.1" not in text)
    return listed | long | anything


def as_header(value: str, encoding: str) -> bytes | str:
    """The value as Envoy would hand it over: its bytes (UTF-8, or latin-1 when that can
    spell it), or as a unicode metadata string in single-message mode."""
    if encoding == "metadata":
        return value
    try:
        return value.encode(encoding)
    except UnicodeEncodeError:
        return value.encode()


def names_nothing(value: bytes | str) -> bool:
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return all(not entry.strip() for entry in text.split(","))


def max_depth(raw: bytes) -> int:
    """How deep containers nest in JSON text (strings skipped), counting the top one."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _walk(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def expected(raw: bytes) -> tuple[str, dict[str, Any] | None]:
    """("400", None), ("pd", the client's object parsed exactly) or ("any", None) when
    the oracle cannot tell (a body Python's json and orjson disagree on)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "400", None  # not JSON (or a number no double holds)
    if max_depth(raw) > MAX_DEPTH:
        return "400", None
    try:
        value = json.loads(raw)
    except ValueError:
        return "any", None
    if not isinstance(value, dict) or GATEWAY_ONLY & value.keys():
        return "400", None
    for item in _walk(value):
        if isinstance(item, int) and not isinstance(item, bool) and not INT_MIN <= item <= INT_MAX:
            return "400", None
    return "pd", value


def top_level_duplicates(raw: bytes) -> list[str]:
    """Keys that appear more than once in the top-level object of `raw`."""
    seen: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen.append(pairs)
        return dict(pairs)

    json.loads(raw, object_pairs_hook=keep)
    keys = [key for key, _ in seen[-1]]  # the outermost object is built last
    return sorted({key for key in keys if keys.count(key) > 1})
