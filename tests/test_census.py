"""The census the soaks check growth with: it finds every structure a connector keeps without being told where
(slots of records included, containers inside containers under `[]`), names a tier's structures by the tier, and
leaves the instruments (the harness's trace, the reference engine, the simulated device) out."""

from __future__ import annotations

from kvfsm.executor.sim import SimDevice
from kvfsm.records import TransferJob
from kvfsm.machines import default_machines
from kvfsm.testing.census import census
from kvfsm.testing.harness import Harness
from kvfsm.tiers.entries import TierEntries


def test_the_census_counts_a_tiers_entries_and_their_slotted_records_by_the_tiers_name() -> None:
    entries = TierEntries("disk", default_machines())
    for key in range(5):
        entries.adopt(key)
    sizes = census(entries)
    assert sizes["TierEntries[disk].by_key"] == sizes["TierEntries[disk]._recency"] == 5
    assert sizes["TierEntry"] == 5, "the entries' records (slots dataclasses) are walked"


def test_the_census_reaches_every_half_of_a_connector_but_not_the_instruments_around_it() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4, keep_history=False)
    try:
        h.add_request((1, 2, 3, 4, 5), 1)
        h.drain()
        classes = {name.split(".")[0].split("[")[0] for name in census(h.connector)}
    finally:
        h.close()
    assert {"Ledger", "TierPlanner", "OffloadingManager", "WorkerConnector", "DiskTier", "TierEntries"} <= classes
    assert not classes & {"Engine", "TraceRecorder", "SimDevice", "Harness"}



def test_the_census_reads_the_slots_of_a_record_and_the_containers_inside_its_containers() -> None:
    job = TransferJob(job_id=1, kind="store", req_id="r", gpu_blocks=(1, 2), cpu_slots=(3, 4), hashes=(5, 6))
    job.reports.update({0: True, 1: False})
    holder = TierEntries("disk", default_machines())
    holder.lookups.append((7, "published"))
    sizes = census(job, holder)
    assert sizes["TransferJob.reports"] == 2 and sizes["TransferJob.gpu_blocks"] == 2
    assert sizes["TierEntries[disk].lookups"] == 1 and sizes["TierEntries[disk].lookups[]"] == 2
