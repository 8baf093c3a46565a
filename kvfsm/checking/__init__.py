"""Runtime checking of an integration against the spec: trace conformance, the named invariants, drain.

Product code, so that adapters and engines check themselves while they run (`kvfsm.integrations.vllm.checks`,
the demo, your own engine through `IntegrationCheck`); `kvfsm.testing` builds its harnesses on the same pieces.
"""

from kvfsm.checking.checks import InvariantViolation, RunChecks
from kvfsm.checking.integration import EngineTables, IntegrationCheck, IntegrationWorld
from kvfsm.checking.trace import TraceRecorder
from kvfsm.checking.world import DEVICE_LOG_INVARIANTS, ConnectorWorld, DeviceLogWorld

__all__ = ["DEVICE_LOG_INVARIANTS", "ConnectorWorld", "DeviceLogWorld", "EngineTables", "IntegrationCheck",
           "IntegrationWorld", "InvariantViolation", "RunChecks", "TraceRecorder"]
