"""SimDevice follows CUDA stream semantics, lets the caller pick the schedule, and logs what it executed."""

from __future__ import annotations

import pytest

from kvfsm.executor import HostPool, PoolClosed, SimDeadlock, SimDevice, SimScheduleError, Touch, UnknownHostBuffer


def trace(device: SimDevice, stream: str, name: str, log: list[str]) -> None:
    device.enqueue(stream, stream, name, lambda: log.append(name))


def test_operations_on_one_stream_run_in_fifo_order() -> None:
    device, log = SimDevice(), []
    for name in ("a", "b", "c"):
        trace(device, "store", name, log)
    device.run_until_idle()
    assert log == ["a", "b", "c"]


def test_nothing_runs_until_the_caller_drives_the_device() -> None:
    device, log = SimDevice(), []
    trace(device, "compute", "a", log)
    event = device.new_event()
    device.record("compute", event)
    assert log == [] and not device.query(event) and not device.idle


def test_a_wait_blocks_its_stream_until_the_event_record_ran() -> None:
    device, log = SimDevice(), []
    trace(device, "compute", "compute", log)
    event = device.new_event()
    device.record("compute", event)
    device.wait("store", event)
    trace(device, "store", "store", log)
    assert device.runnable() == ["compute"]
    with pytest.raises(SimScheduleError):
        device.run_one("store")
    device.run_until_idle(choose=lambda runnable: runnable[-1])
    assert log == ["compute", "store"]


def test_a_wait_binds_to_the_latest_record_issued_before_it() -> None:
    device, log = SimDevice(), []
    event = device.new_event()
    device.record("compute", event)
    device.wait("store", event)
    trace(device, "store", "store", log)
    trace(device, "compute", "later compute", log)
    device.record("compute", event)  # re-recording after the wait does not move what the wait waits for
    device.run_until_idle(choose=lambda runnable: "store" if "store" in runnable else runnable[0])
    assert log == ["store", "later compute"]


def test_a_wait_on_a_never_recorded_event_is_a_no_op() -> None:
    device, log = SimDevice(), []
    device.wait("load", device.new_event())
    trace(device, "load", "load", log)
    assert device.runnable() == ["load"]
    device.run_one("load")
    assert log == ["load"] and device.idle


def test_query_never_runs_anything() -> None:
    device, log = SimDevice(), []
    trace(device, "store", "store", log)
    event = device.new_event()
    device.record("store", event)
    assert not device.query(event) and log == []
    assert device.query(device.new_event())


def test_synchronize_drives_streams_through_the_scheduler() -> None:
    picks: list[list[str]] = []

    def last(runnable: list[str]) -> str:
        picks.append(list(runnable))
        return runnable[-1]

    device, log = SimDevice(scheduler=last), []
    trace(device, "compute", "compute", log)
    trace(device, "store", "store", log)
    event = device.new_event()
    device.record("store", event)
    device.synchronize(event)
    assert log == ["store"] and device.query(event)
    assert picks == [["compute", "store"], ["compute", "store"]]


def test_host_blocking_inside_its_own_streams_operation_is_a_named_deadlock() -> None:
    device = SimDevice()
    event = device.new_event()
    device.enqueue("store", "store", "blocks on itself", lambda: device.synchronize(event))
    device.record("store", event)
    with pytest.raises(SimDeadlock) as deadlock:
        device.run_until_idle()
    assert str(deadlock.value) == "the host waits for record on store (issued #2), but no stream can make progress"


def test_running_a_stream_with_nothing_runnable_is_refused_naming_what_can_run() -> None:
    device = SimDevice()
    device.enqueue("compute", "compute", "compute step 1", lambda: None)
    with pytest.raises(SimScheduleError) as refused:
        device.run_one("load")
    assert str(refused.value) == "stream 'load' has no runnable operation (runnable: ['compute'])"


def test_the_access_log_keeps_issue_and_execution_order() -> None:
    device = SimDevice()
    device.enqueue("compute", "compute", "compute step 1", lambda: None, [Touch("write", "gpu", (3,))])
    device.enqueue("store", "store", "store job 1", lambda: None, [Touch("read", "gpu", (3, 4))])
    device.run_until_idle(choose=lambda runnable: runnable[-1])
    assert [(a.label, a.block) for a in device.accesses] == [("store job 1", 3), ("store job 1", 4),
                                                             ("compute step 1", 3)]
    store, compute = device.accesses[0], device.accesses[-1]
    assert store.issued > compute.issued and store.executed < compute.executed


def test_the_oldest_queued_is_the_earliest_issued_operation_on_any_stream_or_one_past_the_last_issued() -> None:
    device = SimDevice()
    assert device.oldest_queued() == 1
    device.enqueue("store", "store", "store job 1", lambda: None)
    device.enqueue("compute", "compute", "compute step 1", lambda: None)
    device.enqueue("store", "store", "store job 2", lambda: None)
    assert device.oldest_queued() == 1  # on store, although compute comes first among the streams
    device.run_one("store")
    assert device.oldest_queued() == 2  # compute's, older than store's next
    device.run_until_idle()
    assert device.oldest_queued() == 4


def test_queued_names_each_streams_operations_in_issue_order_the_running_one_included_until_it_ran() -> None:
    device = SimDevice()
    assert list(device.queued().items()) == [("compute", []), ("store", []), ("load", [])]
    seen_while_running: list[list[str]] = []
    device.enqueue("store", "store", "store job 1", lambda: seen_while_running.append(device.queued()["store"]))
    device.enqueue("compute", "compute", "compute step 1", lambda: None)
    event = device.new_event()
    device.record("compute", event)
    device.wait("load", event)
    device.enqueue("store", "store", "store job 2", lambda: None)
    expected = [("compute", ["compute step 1", "record on compute"]), ("store", ["store job 1", "store job 2"]),
                ("load", ["wait on load"])]
    assert list(device.queued().items()) == expected
    device.queued()["store"].clear()  # the answer is a copy: changing it leaves the queues as they were
    assert list(device.queued().items()) == expected
    device.run_one("store")
    assert seen_while_running == [["store job 1", "store job 2"]]
    assert device.queued()["store"] == ["store job 2"]
    device.run_until_idle()
    assert list(device.queued().items()) == [("compute", []), ("store", []), ("load", [])]


def test_forgetting_accesses_before_an_issue_number_keeps_those_issued_at_or_after_it_in_execution_order() -> None:
    device = SimDevice()
    device.enqueue("store", "store", "store job 1", lambda: None, [Touch("read", "gpu", (1,))])
    device.enqueue("compute", "compute", "compute step 1", lambda: None, [Touch("write", "gpu", (2,))])
    device.enqueue("store", "store", "store job 2", lambda: None, [Touch("read", "gpu", (3, 4))])
    device.run_until_idle(choose=lambda runnable: runnable[-1])
    device.forget_accesses_before(2)
    assert [(a.issued, a.block) for a in device.accesses] == [(3, 3), (3, 4), (2, 2)]


def test_pin_host_is_exact_and_released_once() -> None:
    device = SimDevice()
    with HostPool(device, num_slots=5, slot_bytes=3000) as pool:
        assert pool.buffer.numel() == pool.registered_bytes == 15000 == device.host_bytes
        assert pool.slot(4).numel() == 3000
    assert device.host_bytes == 0 and pool.registered_bytes == 0
    pool.close()
    with pytest.raises(PoolClosed):
        pool.slot(0)


def test_unpinning_a_foreign_buffer_is_refused() -> None:
    device = SimDevice()
    buffer = device.pin_host(16)
    device.unpin_host(buffer)
    with pytest.raises(UnknownHostBuffer) as refused:
        device.unpin_host(buffer)
    assert str(refused.value) == "this buffer was not allocated by pin_host, or was already released"


def test_a_host_allocation_of_no_bytes_is_refused_and_one_byte_is_not() -> None:
    device = SimDevice()
    with pytest.raises(ValueError) as refused:
        device.pin_host(0)
    assert str(refused.value) == "a host allocation needs a positive size, got 0"
    device.unpin_host(device.pin_host(1))



def test_draining_the_device_from_inside_one_of_its_operations_is_a_named_deadlock() -> None:
    device = SimDevice()
    device.enqueue("store", "store", "drains the device", lambda: device.run_until_idle())
    device.enqueue("store", "store", "store job 1", lambda: None)
    with pytest.raises(SimDeadlock) as deadlock:
        device.run_until_idle()
    assert str(deadlock.value) == "operations remain queued, but no stream can make progress"
