"""The executor: devices (real and simulated), the pinned host pool, KV-cache layouts and transfer mechanisms."""

from kvfsm.executor.cuda import CudaDevice, CudaUnavailable, HostRegisterError
from kvfsm.executor.device import STREAMS, Device, Event, StreamName, Touch
from kvfsm.executor.layouts import LAYOUTS, KVCaches, LayoutError, Plane, register_kv_caches
from kvfsm.executor.mechanisms import MECHANISMS, MechanismError
from kvfsm.executor.pool import HostPool, PoolClosed
from kvfsm.executor.sim import SimDeadlock, SimDevice, SimScheduleError, UnknownHostBuffer
from kvfsm.executor.transfer import POISON_BYTE, IdOutOfRange, TransferError, Transfers

__all__ = [
    "CudaDevice", "CudaUnavailable", "HostRegisterError",
    "STREAMS", "Device", "Event", "StreamName", "Touch",
    "LAYOUTS", "KVCaches", "LayoutError", "Plane", "register_kv_caches",
    "MECHANISMS", "MechanismError",
    "HostPool", "PoolClosed",
    "SimDeadlock", "SimDevice", "SimScheduleError", "UnknownHostBuffer",
    "POISON_BYTE", "IdOutOfRange", "TransferError", "Transfers",
]
