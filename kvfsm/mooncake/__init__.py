"""A shared lower tier on Mooncake Store (optional: `pip install 'kvfsm[mooncake]'`).

Nothing here imports Mooncake at module load; `kvfsm.mooncake.available()` says whether it is installed.
"""

from __future__ import annotations


def available() -> bool:
    """Whether Mooncake Store's Python bindings and the MAC's `blake3` load (the `mooncake` extra, and Debian's
    `libibverbs1`)."""
    try:
        import blake3  # noqa: F401
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True
