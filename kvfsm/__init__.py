"""kvfsm: KV-cache offloading whose lifecycles are declared in `spec/` and enforced by machines.

The names below are imported on first use (`lazy_loader`): `Connector` brings torch, and every
`python -m kvfsm.<command>` imports this package first, `--help` included.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__, submod_attrs={"config": ["OffloadConfig"], "connector": ["Connector"]})
