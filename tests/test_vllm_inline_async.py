"""No inline load under vLLM's async scheduling (`no-inline-load-under-async-scheduling`), on vLLM's real
`AsyncScheduler`.

With async scheduling vLLM schedules step N+1 before it read step N's output. A load computed in its own step that
fails is reported in step N's output, by which time step N+1 has computed on the blocks that did not land: vLLM
0.32's recovery (`_handle_invalid_blocks`) rewinds the request's computed tokens but does not discard the step in
flight, whose token it emits; and a request it preempted before reading that output is not among the running
requests it scans, so the unlanded blocks stay in its GPU prefix cache. No connector hook can take that step back,
so kvfsm answers every CPU hit as an asynchronous load there, whatever `layer_loads` says: read once from vLLM's
configuration, logged at start-up, counted in `kvfsm_loads_total{mode}`. The mutant that keeps loads inline is caught
by name; with that check silenced it shows the hazard, a token computed on KV that never landed.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.config import InvalidExtraConfig, offload_config  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, vllm_config  # noqa: E402
from kvfsm.states import RequestState  # noqa: E402
from kvfsm.testing.mutants import inline_under_async_scheduling  # noqa: E402
from test_vllm_inline import INLINE, failed_inline_load, reload, states  # noqa: E402,F401
from vllm_support import loads_of, make_driver, model, scraped  # noqa: E402,F401

pytestmark = pytest.mark.vllm

RULE = "no-inline-load-under-async-scheduling"


def test_a_cpu_hit_with_layer_loads_loads_asynchronously_under_async_scheduling(make_driver, states) -> None:
    d = make_driver(async_scheduling=True, **INLINE)
    seen = states(d)
    step = reload(d)
    assert d.first_token["reader"] == step + 2  # as without layer_loads: computed once its report was read
    assert RequestState.LOADING in seen.seen["reader"]
    assert RequestState.LOADING_INLINE not in seen.seen["reader"]
    stats = d.connector.scheduler_side.kvfsm.stats
    assert (stats.loads_inline, stats.loads_async) == (0, 1)
    assert d.cpu_pool_drained()


def test_control_inline_loads_under_async_scheduling_are_caught(make_driver) -> None:
    d = make_driver(async_scheduling=True, **INLINE)
    inline_under_async_scheduling(d.connector.scheduler_side.kvfsm)
    with pytest.raises(SpecViolation, match=RULE):
        reload(d)


def test_control_a_failed_inline_load_under_async_scheduling_emits_a_token_computed_on_unlanded_kv(
        make_driver, monkeypatch) -> None:
    """Why the rule exists: with the mutant and the rule's check silenced, the step scheduled before the failing
    step's output was read decodes on the blocks that did not land and vLLM emits its token; the recompute from the
    first failed block comes only after it."""
    d = make_driver(FakeWorker(fail_loads={"reader"}), async_scheduling=True, **INLINE)
    inline_under_async_scheduling(d.connector.scheduler_side.kvfsm)
    violations = d.checks.violations
    monkeypatch.setattr(d.checks, "violations",
                        lambda: {name: lines for name, lines in violations().items() if name != RULE})
    step, _ = failed_inline_load(d)
    assert d.first_token["reader"] == step + 1
    assert next(log.computed["reader"] for log in d.log if log.step == step + 2) == 2 * BLOCK_SIZE


def test_a_failed_load_under_async_scheduling_is_recomputed_before_any_token(make_driver) -> None:
    d = make_driver(FakeWorker(fail_loads={"reader"}), async_scheduling=True, **INLINE)
    step, _ = failed_inline_load(d)
    (load,) = loads_of(d, "reader")
    assert len(load.gpu_blocks) == 2
    computed = next(log for log in d.log if log.step > step and "reader" in log.computed)
    assert computed.computed["reader"] == 2 * BLOCK_SIZE  # from the first block that did not land
    assert d.first_token["reader"] >= computed.step
    assert d.connector.scheduler_side.kvfsm.stats.loads_failed == 1
    assert d.cpu_pool_drained()


def test_async_scheduling_is_vllms_and_a_contradiction_is_refused(model) -> None:
    config = offload_config(vllm_config(model, {"cpu_blocks": 4, "layer_loads": True}, 16, async_scheduling=True))
    assert config.async_scheduling and config.layer_loads and not config.inline_loads
    with pytest.raises(InvalidExtraConfig, match="async_scheduling=False, but vLLM runs with True"):
        offload_config(vllm_config(model, {"cpu_blocks": 4, "async_scheduling": False}, 16, async_scheduling=True))


def test_pipeline_parallelism_schedules_ahead_too(model) -> None:
    """vLLM's engine core keeps a batch per pipeline stage in flight, async scheduling or not."""
    config = offload_config(vllm_config(model, {"cpu_blocks": 4, "layer_loads": True}, 16, pipeline_parallel_size=2))
    assert config.async_scheduling and not config.inline_loads


def test_the_layer_loads_fallback_warning_says_why_and_how_to_get_layer_loads(make_driver, caplog) -> None:
    """The start-up log is the user's only sign that the `layer_loads` they set is not served: it names the setting,
    the cause, where the fallback is counted, and what serves per-layer loads."""
    with caplog.at_level(logging.WARNING, logger="kvfsm.integrations.vllm.scheduler_side"):
        make_driver(async_scheduling=True, **INLINE)
    assert [r.getMessage() for r in caplog.records if r.name.endswith("scheduler_side")] == [
        "kvfsm: layer_loads is set but vLLM schedules each step before it read the previous one's output (async "
        "scheduling, or pipeline parallelism), so a failed load's step could not be taken back; CPU hits load "
        "asynchronously instead (kvfsm_loads_total{mode=\"async\"}). Per-layer loads need --no-async-scheduling and no "
        "pipeline parallelism."]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_layer_loads_falling_back_is_logged_once_and_counted(make_driver, caplog, async_scheduling: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="kvfsm.integrations.vllm.scheduler_side"):
        d = make_driver(async_scheduling=async_scheduling, **INLINE)
        reload(d)
    warned = [r for r in caplog.records if "async scheduling" in r.getMessage()]
    assert len(warned) == async_scheduling
    registry = scraped(d)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("kvfsm_loads_total", {**labels, "mode": "async"}) == async_scheduling
    assert registry.get_sample_value("kvfsm_loads_total", {**labels, "mode": "inline"}) == (not async_scheduling)
