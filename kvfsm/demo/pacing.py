"""The simulated GPU running up to one engine step behind the host, as it may under async scheduling.

On `SimDevice` the virtual GPU picks the next stream at random (seeded) among those that may run, and with this lag
a store, a load and the next step's compute really do overtake one another. (The CPU that runs the simulator is the
one that would run the GPU, so the lag buys no speed here; it is there so the ordering rules are exercised. The
generated interleavings in the test suite explore every lag and every schedule.) Accesses that can no longer be
overtaken are dropped from the device's log once checked, so checking stays linear in the length of the run.
`kvfsm.demo.runs` and `kvfsm.tp` pace their simulated devices with it.
"""

from __future__ import annotations

from kvfsm.executor.device import STREAMS
from kvfsm.executor.sim import SimDevice, SimEvent


class OneStepBehind:
    """Lets the simulated GPU run up to one engine step behind the host, as async scheduling allows on a real one.

    After each step a marker is recorded on every stream, and the host waits for the previous step's markers: step
    N's device work may still be running (interleaved at random with step N+1's) when step N+1 is scheduled."""

    def __init__(self, device: SimDevice) -> None:
        self.device = device
        self._previous: list[SimEvent] = []
        self._settled = 0

    def after_step(self) -> None:
        markers = [self.device.new_event() for _ in STREAMS]
        for stream, marker in zip(STREAMS, markers):
            self.device.record(stream, marker)
        for marker in self._previous:
            self.device.synchronize(marker)
        self._settled = min((m.latest.issued for m in self._previous if m.latest is not None), default=0)
        self._previous = markers

    def forget_checked(self) -> None:
        """Drop accesses of operations issued before the last markers waited for, once they have been checked.

        All of those ran, and anything not yet run was issued after them, so none of theirs can still be
        overtaken by an operation issued earlier: the ordering invariants have nothing more to find in them."""
        self.device.forget_accesses_before(self._settled)

    def finish(self) -> None:
        self.device.run_until_idle()
