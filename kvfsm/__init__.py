"""kvfsm: KV-cache offloading whose lifecycles are declared in `spec/` and enforced by machines."""

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector

__all__ = ["Connector", "OffloadConfig"]
