"""Run a Python program with a bytecode counter, for bench.opcodes (not imported by it).

    python bench/opcode_tracer.py OUT.json SCRIPT [ARGS...]

runs SCRIPT (a console script such as `pdproc`, or bench/floor.py) as `__main__`. SIGUSR1
starts counting, in the main thread (the event loop's): every bytecode executed, by the
function that executed it; SIGUSR2 stops and writes OUT.json, a list of
[file, first line, name, bytecodes, calls]. A function's calls include a coroutine's
resumptions. Counting slows the program some fifty times, so it runs only in the window.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import signal
import sys
from types import FrameType
from typing import Any

Key = tuple[str, int, str]
_counts: collections.Counter[Key] = collections.Counter()
_calls: collections.Counter[Key] = collections.Counter()


def _key(frame: FrameType) -> Key:
    code = frame.f_code
    name = code.co_qualname
    if code.co_filename == "<string>":
        # A method a dataclass or NamedTuple generated: named after the class of its self.
        name = f"{type(frame.f_locals.get('self')).__name__}.{code.co_name}"
    return (code.co_filename, code.co_firstlineno, name)


def _trace(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "call":
        frame.f_trace_opcodes = True
        _calls[_key(frame)] += 1
    elif event == "opcode":
        _counts[_key(frame)] += 1
    return _trace


def _start(*_: object) -> None:
    _counts.clear()
    _calls.clear()
    sys.settrace(_trace)


def _stop(out: str) -> None:
    sys.settrace(None)
    counts, calls = dict(_counts), dict(_calls)
    rows = [[*key, n, calls.get(key, 0)] for key, n in counts.items()]
    # Written beside, then renamed: whoever waits for OUT never reads it half written.
    with open(out + ".part", "w") as f:
        json.dump(rows, f)
    os.replace(out + ".part", out)


def main() -> None:
    out, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, lambda *_: _stop(out))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
