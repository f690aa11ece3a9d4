"""Attack 7: bad bytes in `x-prefiller-host-port`.

At c46c4db the port was checked with `str.isdigit()`, which is true for a superscript two
(U+00B2) and other non-ASCII digits, while `int()` refuses them: `10.0.0.1:80` followed by
a superscript two became a 500 from pdproc's catch-all. Now targets are ASCII only, and
anything else is a 400.
"""

from __future__ import annotations

from typing import Any

import pytest
from pdproc_sim.devstack import Stack

from pdproc.targets import AllowList

from .conftest import CHAT_BYTES, Pd, is_single_message, records, send, served
from .pods import HostilePod

# Header bytes as they arrive from Envoy: pdproc reads them as latin-1. The look-alike
# digits are written as escapes on purpose (they are the attack).
SUPERSCRIPT_TWO = "\u00b2"  # "2" superscript: str.isdigit() is true, int() refuses it
FULLWIDTH_80 = "\uff18\uff10"
ARABIC_INDIC_ZERO = "\u0660"
BOLD_80 = "\U0001d7d6\U0001d7ce"
FULLWIDTH_10 = "\uff11\uff10"
BAD_BYTES = {
    "superscript-latin1": b"10.0.0.1:80\xb2",  # one byte: latin-1 "80" + superscript two
    "superscript-utf8": f"10.0.0.1:80{SUPERSCRIPT_TWO}".encode(),
    "fullwidth-digits": f"10.0.0.1:{FULLWIDTH_80}".encode(),
    "arabic-indic-digit": f"10.0.0.1:8{ARABIC_INDIC_ZERO}".encode(),
    "fullwidth-host": f"{FULLWIDTH_10}.0.0.1:80".encode(),
    "nul": b"10.0.0.1:80\x00",
    "high-bytes": b"\xff\xfe:80",
}
# Every target allowed: only the parser stands between the header and a connection.
ALLOW_ALL = AllowList.parse(["*"])
# In single-message mode the value arrives as a (unicode) metadata string.
BAD_TEXT = [
    f"10.0.0.1:80{SUPERSCRIPT_TWO}",
    f"10.0.0.1:8{ARABIC_INDIC_ZERO}",
    f"10.0.0.1:{BOLD_80}",
    f"{FULLWIDTH_10}.0.0.1:80",
    "[::1%\uff12]:80",
]


@pytest.mark.parametrize("value", list(BAD_BYTES.values()), ids=list(BAD_BYTES))
async def test_non_ascii_target_bytes_get_400(
    pod: HostilePod, make_pdproc: Any, value: bytes
) -> None:
    pd: Pd = await make_pdproc(pod, prefill_allow=ALLOW_ALL)
    outcome = await pd.play(CHAT_BYTES, prefill=value)
    assert outcome.status == 400, outcome.error
    assert outcome.error_kind == "bad_request"
    assert outcome.decode_body is None
    assert pod.total_hits == 0


@pytest.mark.parametrize("value", BAD_TEXT)
async def test_non_ascii_target_text_gets_400_in_single_message_mode(
    pod: HostilePod, make_pdproc: Any, value: str
) -> None:
    pd: Pd = await make_pdproc(pod, prefill_allow=ALLOW_ALL)
    outcome = await pd.play(CHAT_BYTES, prefill=value, single_message=True)
    assert outcome.status == 400, outcome.error
    assert outcome.error_kind == "bad_request"
    assert pod.total_hits == 0


@pytest.mark.e2e
@pytest.mark.parametrize(
    "value",
    [BAD_BYTES["superscript-latin1"], BAD_BYTES["superscript-utf8"]],
    ids=["latin1", "utf8"],
)
def test_superscript_port_through_envoy_gets_400(fresh: Stack, value: bytes) -> None:
    response = send(fresh, CHAT_BYTES, value)
    if is_single_message(fresh) and not is_utf8(value):
        # header_to_metadata does not carry a value that is not UTF-8: pdproc never sees
        # it and the decode serves the request alone, as without the header.
        assert response.status_code == 200, response.text
        (decode,) = served(fresh, "decode", 1)
        assert "kv_transfer_params" not in decode["body"]
    else:
        assert response.status_code == 400, response.text
        assert response.headers["x-pdproc-error"] == "bad_request"
        assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


def is_utf8(value: bytes) -> bool:
    try:
        value.decode()
    except UnicodeDecodeError:
        return False
    return True
