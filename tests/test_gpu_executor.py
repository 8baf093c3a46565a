"""The executor on a real GPU: round trips in every layout, an exact pinned pool, and the two copy-stream races
reproduced with a delayed stream, where the control (no event wait) must corrupt and kvfsm's path never does."""

from __future__ import annotations

import threading

import pytest
import torch

from kvfsm.executor import LAYOUTS, MECHANISMS, POISON_BYTE, CudaDevice, HostPool, KVCaches, Transfers
from kvfsm.executor import graphs, register_kv_caches
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.gather import SlotOverflow
from kvfsm.executor.mechanisms import BLOCK_CONTIGUOUS_ONLY

pytestmark = pytest.mark.gpu
TRIALS = 50
SLEEP_CYCLES = 20_000_000  # ~10 ms at H100 clocks: far longer than the copies it races


def rig(layout: str, k: int, mechanism: str, staging_blocks: int = 5,
        layers: int = 4) -> tuple[CudaDevice, KVCaches, HostPool, Transfers]:
    device = CudaDevice()
    tensors, groups = allocate_kv_caches(layout, layers, 64, 16, 2, 64, torch.bfloat16, "cuda", 2)
    for t in tensors.values():
        t.view(torch.uint8).view(-1).random_(0, 256)
    torch.cuda.synchronize()  # filled on the compute stream, which the tests' direct transfers do not wait for
    caches = register_kv_caches(tensors, layout, groups)
    pool = HostPool(device, 32, k * caches.gpu_block_bytes)
    return device, caches, pool, Transfers(device, caches, pool, k, mechanism,
                                           staging_bytes=staging_blocks * caches.gpu_block_bytes)


def block(caches: KVCaches, b: int) -> torch.Tensor:
    return torch.cat([plane.rows[p, b] for plane in caches.planes for p in range(plane.pieces)])


def settle(device: CudaDevice, stream: str) -> None:
    event = device.new_event()
    device.record(stream, event)
    device.synchronize(event)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize(("layout", "mechanism"),
                         [(lay, m) for lay in LAYOUTS for m in MECHANISMS
                          if m not in BLOCK_CONTIGUOUS_ONLY or lay != "kv-first"])
def test_cuda_round_trip_is_byte_exact(layout: str, mechanism: str, k: int) -> None:
    device, caches, pool, transfers = rig(layout, k, mechanism)
    shift = 1 if k > 1 else 0  # with several blocks per slot, start the load inside the first one
    sources = torch.randperm(64)[:12 if k == 1 else 16].tolist()
    slots = torch.randperm(32)[:len(sources) // k].tolist()
    expected = [block(caches, b).clone() for b in sources]
    torch.cuda.synchronize()  # the copies are made on the compute stream: taken before the poison lands
    transfers.store(sources, slots)
    settle(device, "store")
    targets = torch.randperm(64)[:len(sources) - shift].tolist()
    transfers.poison_gpu(range(64), "load")
    transfers.load(slots, targets, gpu_offset=shift)
    settle(device, "load")
    for i, b in enumerate(targets):
        assert torch.equal(block(caches, b), expected[i + shift])
    pool.close()


def test_cuda_pool_registers_exactly_the_configured_bytes() -> None:
    device = CudaDevice()
    slot_bytes = 3 * (2 << 20) + 4096  # deliberately not a power of two
    with HostPool(device, 7, slot_bytes) as pool:
        assert pool.registered_bytes == pool.buffer.numel() == device.host_bytes == 7 * slot_bytes
        assert pool.buffer.is_pinned()
    assert device.host_bytes == 0


def store_race(wait: bool) -> int:
    """Trials in which a store copied stale bytes: compute (delayed) rewrites block 1, then the store reads it."""
    device, caches, pool, transfers = rig("kv-first", 1, "auto")
    corrupt = 0
    for trial in range(TRIALS):
        value = trial % 200 + 1
        transfers.poison_cpu([0], "store")
        settle(device, "store")
        computed = device.new_event()

        def write() -> None:
            torch.cuda._sleep(SLEEP_CYCLES)
            for plane in caches.planes:
                plane.rows[:, 1].fill_(value)

        device.enqueue("compute", "compute", "compute", write)
        device.record("compute", computed)
        if wait:
            device.wait("store", computed)
        transfers.store([1], [0])
        settle(device, "store")
        settle(device, "compute")
        corrupt += not bool((pool.slot(0) == value).all())
    pool.close()
    return corrupt


def load_race(wait: bool) -> int:
    """Trials in which a load overwrote block 2 before an earlier (delayed) store had read it."""
    device, caches, pool, transfers = rig("kv-first", 1, "auto")
    corrupt = 0
    for trial in range(TRIALS):
        value = trial % 200 + 1
        for plane in caches.planes:
            plane.rows[:, 2].fill_(value)
        pool.slot(1).fill_(POISON_BYTE)
        torch.cuda.synchronize()
        device.enqueue("store", "store", "delay", lambda: torch.cuda._sleep(SLEEP_CYCLES))
        transfers.store([2], [0])
        stored = device.new_event()
        device.record("store", stored)
        if wait:
            device.wait("load", stored)
        transfers.load([1], [2])
        settle(device, "load")
        settle(device, "store")
        corrupt += not bool((pool.slot(0) == value).all())
    pool.close()
    return corrupt


@pytest.mark.parametrize("race", [store_race, load_race], ids=["store-after-compute", "load-after-readers"])
def test_delayed_stream_race_corrupts_the_control_and_never_kvfsm(race, record_property) -> None:
    control, kvfsm = race(wait=False), race(wait=True)
    record_property("corrupt", {"control": control, "kvfsm": kvfsm, "trials": TRIALS})
    print(f"\n{race.__name__}: control corrupt {control}/{TRIALS}, kvfsm corrupt {kvfsm}/{TRIALS}")
    assert control > TRIALS // 2
    assert kvfsm == 0


def test_poisoning_cpu_slots_takes_its_turn_on_the_stream_without_holding_up_the_host() -> None:
    """The poison of a CPU slot is a copy on the named stream: it lands only after what that stream already runs
    (a fill done at once by the host could hit a slot that a copy in flight still writes), and the host does not
    wait for it."""
    device = CudaDevice()
    tensors, groups = allocate_kv_caches("kv-first", 2, 8, 16, 2, 64, torch.bfloat16, "cuda")
    caches = register_kv_caches(tensors, "kv-first", groups)
    with HostPool(device, 2, caches.gpu_block_bytes) as pool:
        transfers = Transfers(device, caches, pool, 1)
        transfers.poison_cpu([0], "store")  # the first fill loads its kernel, which waits for the whole GPU
        done = device.new_event()
        device.record("store", done)
        device.synchronize(done)
        device.enqueue("store", "store", "delay", lambda: torch.cuda._sleep(100_000_000))  # ~50 ms on an H100
        transfers.poison_cpu([1], "store")
        poisoned_at_once = bool((pool.slot(1) == POISON_BYTE).any())
        device.record("store", done)
        device.synchronize(done)
        assert (poisoned_at_once, bool((pool.slot(1) == POISON_BYTE).all())) == (False, True)


def gathered_fast_and_per_plane(caches: KVCaches, transfers: Transfers, fast: str, blocks: list[int],
                                earlier: tuple[list[int], ...] = (),
                                paced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`blocks` gathered into staging slot 0 by the mechanism's faster path `fast` (after `earlier` went through
    the same slot; `paced` for a graph replay), and into slot 1 by a launch per plane from the host: the two slots'
    filled bytes."""
    mechanism = transfers._mechanism
    assert getattr(mechanism, fast) is not None, f"on this GPU the {fast} path must be in use"
    for slot in mechanism._staging["store"]:
        slot.fill_(POISON_BYTE)
    for ids in (*earlier, blocks):
        mechanism._gather(ids, transfers._block_ids(ids), 0, paced)
    faster = getattr(mechanism, fast)
    setattr(mechanism, fast, None)
    mechanism._gather(blocks, transfers._block_ids(blocks), 1)
    setattr(mechanism, fast, faster)
    torch.cuda.synchronize()
    n = len(blocks) * caches.gpu_block_bytes
    first, second = (slot[:n] for slot in mechanism._staging["store"])
    return first, second


@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replayed_graph_gathers_each_full_chunk_s_own_blocks_as_a_launch_per_plane_does(layout: str,
                                                                                           paced: bool) -> None:
    """staged-gather replays a full chunk's captured gathers, back to back or paced: the slot must hold that
    chunk's blocks, the same bytes the launches from the host put there, even right after another chunk went
    through the same slot."""
    _, caches, pool, transfers = rig(layout, 1, "staged-gather")
    chunk = transfers._mechanism.chunk_blocks
    earlier, blocks = torch.randperm(64)[:2 * chunk].view(2, chunk).tolist()
    graph, per_plane = gathered_fast_and_per_plane(caches, transfers, "_graphs", blocks, (earlier,), paced)
    assert torch.equal(graph, per_plane)
    assert torch.equal(graph, torch.cat([block(caches, b) for b in blocks]))
    pool.close()


@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replayed_graph_scatters_a_full_chunk_into_its_own_blocks_only(layout: str, paced: bool) -> None:
    """staged-gather replays a full chunk's captured scatters, back to back or paced: each block of the chunk gets
    its row of the slot, right after another chunk went through the same slot, and no other block is written."""
    device, caches, pool, transfers = rig(layout, 1, "staged-gather")
    mechanism = transfers._mechanism
    assert mechanism._graphs is not None, "on a GPU, staged-gather's full chunks must replay captured launches"
    chunk = mechanism.chunk_blocks
    earlier, blocks = torch.randperm(64)[:2 * chunk].view(2, chunk).tolist()
    sources = [b for b in range(64) if b not in earlier + blocks][:chunk]
    rows = torch.cat([block(caches, b) for b in sources])
    untouched = {b: block(caches, b).clone() for b in range(64) if b not in earlier + blocks}
    mechanism._staging["load"][0][:rows.numel()].copy_(rows)
    mechanism._scatter(earlier, transfers._block_ids(earlier), 0, paced)
    mechanism._scatter(blocks, transfers._block_ids(blocks), 0, paced)
    torch.cuda.synchronize()
    assert all(torch.equal(block(caches, b), block(caches, s)) for b, s in zip(blocks, sources))
    assert all(torch.equal(block(caches, b), want) for b, want in untouched.items())
    pool.close()


def held_by_captured_pauses(ns: int, pauses: int = 10) -> float:
    """Milliseconds a replayed graph of `pauses` pauses of `ns` nanoseconds each held its stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphs.pause(ns)  # once outside the capture, as graphs.SlotGraphs does: the kernel is compiled here
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(pauses):
                graphs.pause(ns)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        graph.replay()
        end.record(side)
    end.synchronize()
    return start.elapsed_time(end)


def test_a_captured_pause_holds_its_stream_for_at_least_its_nanoseconds() -> None:
    """A paced replay's pauses are timed by the GPU's clock of nanoseconds, so they last as long on a GPU at any
    SM clock; ten of 100 µs each must hold the stream 1 ms at least. The control, ten pauses of nothing, shows
    the measurement would see pauses that do not wait."""
    assert held_by_captured_pauses(100_000) >= 1.0
    assert held_by_captured_pauses(0) < 1.0


def replay_ms(transfers: Transfers, blocks: list[int], paced: bool, trials: int = 3) -> float:
    """The shortest of `trials` replays of a full chunk's captured gathers (`paced` or back to back), in ms."""
    mechanism, index = transfers._mechanism, transfers._block_ids(blocks)
    times = []
    for _ in range(trials + 1):  # the first replay is a warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mechanism._graphs["store"](index, 0, paced)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times[1:])


def test_a_paced_replay_pauses_between_planes_and_a_back_to_back_one_does_not() -> None:
    """A full chunk's paced replay (chunks whose gathers overlap other chunks' DMA) leaves a concurrent kernel its
    SMs by a `graphs.PACE_NS` pause between planes: with 32 planes it holds its stream 31 pauses at least. The
    back-to-back replay (the pipeline's first gather, which the copy engine waits for) has no pause, and ends well
    before that: the measurement tells the two apart."""
    _, caches, pool, transfers = rig("kv-first", 1, "staged-gather", layers=32)
    pauses_ms = (len(caches.planes) - 1) * graphs.PACE_NS / 1e6
    blocks = list(range(transfers._mechanism.chunk_blocks))
    assert replay_ms(transfers, blocks, paced=True) >= pauses_ms
    assert replay_ms(transfers, blocks, paced=False) < pauses_ms
    pool.close()


def capture_beside_a_thread_using_cuda() -> list[str]:
    """Capture `graphs.SlotGraphs` whose launches, while captured, wait for another thread that synchronizes a
    stream of its own (an engine thread using CUDA meanwhile): what that thread's CUDA calls raised."""
    errors: list[str] = []

    def use_cuda() -> None:
        try:
            torch.cuda.Stream().synchronize()
        except Exception as err:  # noqa: BLE001 (the test reports whatever the other thread hit)
            errors.append(f"{type(err).__name__}: {err}")

    def launches(index: torch.Tensor, slot: int, ns: int) -> None:
        index.add_(0)
        if torch.cuda.is_current_stream_capturing():
            other = threading.Thread(target=use_cuda)
            other.start()
            other.join()

    graphs.SlotGraphs(launches, 1, 4, torch.device("cuda", torch.cuda.current_device()))
    return errors


def test_capturing_a_slot_s_graphs_leaves_other_threads_free_to_use_cuda() -> None:
    """Caches are registered, and their graphs captured, while an engine's other threads may use CUDA: the capture
    must confine its restrictions to its own thread. The control is a capture in torch's global mode, where the
    other thread's synchronize is refused and the capture fails; it runs as a mutant (`graphs.SlotGraphs._capture`
    without `capture_error_mode`), killed by this test on the GPU, not here: a failed capture leaves the process's
    CUDA state unfit for the tests after it."""
    assert capture_beside_a_thread_using_cuda() == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_launch_gathers_the_bytes_a_launch_per_plane_gathers(layout: str) -> None:
    """fused-gather's one launch (Triton, every plane at once) fills a staging slot with exactly the blocks asked
    for, as staged-gather's index_select per plane does."""
    _, caches, pool, transfers = rig(layout, 1, "fused-gather")
    blocks = torch.randperm(64)[:5].tolist()
    staged, per_plane = gathered_fast_and_per_plane(caches, transfers, "_one_launch", blocks)
    assert torch.equal(staged, per_plane)
    assert torch.equal(staged, torch.cat([block(caches, b) for b in blocks]))
    pool.close()


def test_one_launch_gathers_refuse_more_blocks_than_a_staging_slot_holds() -> None:
    """A kernel writing past its slot would corrupt whatever lies beyond it, silently: refused before launch. A
    one-block slot still builds the kernel (its warm-up gathers one block) and gathers into it."""
    _, caches, pool, transfers = rig("kv-first", 1, "fused-gather", staging_blocks=1)
    one_launch = transfers._mechanism._one_launch
    assert one_launch is not None, "a one-block staging slot must still build the one-launch gather"
    slot = transfers._mechanism._words["store"][0]
    with pytest.raises(SlotOverflow, match="2 blocks do not fit a staging slot of 1"):
        one_launch(transfers._block_ids([3, 4]), slot)
    one_launch(transfers._block_ids([3]), slot)
    torch.cuda.synchronize()
    assert torch.equal(transfers._mechanism._staging["store"][0], block(caches, 3))
    pool.close()
