"""The scheduler half's ledger tables, as the spec's invariants and the checks read them.

`SchedulerConnector` keeps its jobs, requests, due points, GPU fences and deferrals in one `Ledger`; the checks
(`kvfsm.checking`, the invariants) read them as the connector's own attributes. These read-only views live in a base
class of their own so the scheduler half's module holds only what it decides (lookup, orders, completions).
"""

from __future__ import annotations

from kvfsm.connector.due import StoreDue
from kvfsm.connector.ledger import Ledger
from kvfsm.connector.refusals import UnknownRequest
from kvfsm.invariants import Deferral
from kvfsm.records import GpuBlock, RequestRecord, TransferJob
from kvfsm.states import RequestState
from kvfsm.tier_records import TierJob


class LedgerTables:
    """Read-only views of `ledger`'s tables, under the names the invariants use."""

    ledger: Ledger

    @property
    def jobs(self) -> dict[int, TransferJob]:
        return self.ledger.jobs

    @property
    def tier_jobs(self) -> dict[int, TierJob]:
        """Write-backs and fetches, on the same ledger and under the same history policy as `jobs`."""
        return self.ledger.tier_jobs

    @property
    def requests(self) -> dict[str, RequestRecord]:
        return self.ledger.requests

    @property
    def tracked(self) -> dict[str, RequestRecord]:
        """Requests not yet released."""
        return self.ledger.tracked

    @property
    def store_due(self) -> dict[str, int]:
        """Each tracked request's computed-token count at which its next CPU block completes."""
        return self.ledger.due.tokens

    @property
    def due(self) -> StoreDue:
        """The due points, with the batch last found quiet."""
        return self.ledger.due

    @property
    def gpu_blocks(self) -> dict[int, GpuBlock]:
        return self.ledger.fences.fenced()

    @property
    def deferrals(self) -> dict[str, Deferral]:
        return self.ledger.deferrals

    @property
    def reported_failed(self) -> set[int]:
        return self.ledger.reported_failed

    def _get(self, request_id: str) -> RequestRecord:
        """The tracked request's record; refused by name (`UnknownRequest`) for one the connector does not track."""
        record = self.ledger.tracked.get(request_id)
        if record is None:
            raise UnknownRequest(f"request {request_id!r} is not tracked by the connector")
        return record

    def tracks(self, request_id: str) -> bool:
        """Whether the request is still known (a returned one until its last store ends): its id may not return."""
        return request_id in self.ledger.tracked

    @property
    def stores_of_ended_requests(self) -> bool:
        """An ended request's stores are in flight: an engine with nothing else to do steps until they end."""
        return any(record.state == RequestState.RETURNED for record in self.ledger.tracked.values())
