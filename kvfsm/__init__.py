"""kvfsm: KV-cache offloading whose lifecycles are declared in `kvfsm/lifecycles/` and enforced by machines."""

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector

__all__ = ["Connector", "OffloadConfig"]
