"""kvfsm: KV-cache offloading whose lifecycles are declared in `kvfsm/lifecycles/` and enforced by machines.

The names below are imported on first use (`kvfsm.lazy`): `Connector` brings torch, and every
`python -m kvfsm.<command>` imports this package first, `--help` included.
"""

from kvfsm import lazy

_HOMES = {"config": ("OffloadConfig",), "connector": ("Connector",)}
__all__ = lazy.exported(_HOMES)
__getattr__ = lazy.attributes(__name__, _HOMES)
