"""How many examples the property tests try. A test that wants more or fewer than Hypothesis's
default (100) asks for `examples(n)`: `n` under the default profile (`make test`), scaled
down with the profile's own `max_examples` under `--hypothesis-profile unit` (`make unit`,
the fast loop: a third of every count, explicit `@example`s all kept)."""

from __future__ import annotations

from hypothesis import settings

# No timing assertions, Hypothesis' per-example deadline included: on a shared box a slow
# example is the machine, not a bug (bodies of several MiB are generated on purpose).
settings.register_profile("pdproc", deadline=None)
settings.register_profile("unit", parent=settings.get_profile("pdproc"), max_examples=34)
settings.load_profile("pdproc")


def examples(n: int) -> int:
    """`n` examples scaled as the loaded profile scales the default 100."""
    return max(1, n * settings().max_examples // 100)
