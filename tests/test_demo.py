"""The demo: returning prefixes reload from CPU instead of being recomputed, and integrity is checked, not assumed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvfsm.demo import DemoConfig, DemoConfigError, DeviceKind, app, run_demo
from kvfsm.workload import WorkloadError, WorkloadShape, generate, minimum_compute

SMALL = WorkloadShape(conversations=4, turns=3, agents=3, think_steps=12, shared_prefix_tokens=64)
SMALL_ARGS = ["--device", "cpu", "--conversations", "4", "--turns", "3", "--agents", "3", "--gpu-blocks", "32"]


def small(**overrides: object) -> DemoConfig:
    return DemoConfig(**{"workload": SMALL, "gpu_blocks": 24, "cpu_blocks": 128, "device": DeviceKind.cpu,
                         **overrides})  # type: ignore[arg-type]


def test_offloaded_run_reloads_from_cpu_and_keeps_integrity() -> None:
    result = run_demo(small())
    assert result.outputs_identical
    assert result.offloaded.cpu_hit_tokens > 0
    assert result.offloaded.violations == {}
    assert result.poisoned == []
    assert result.ok


def test_cpu_hits_replace_recomputation() -> None:
    result = run_demo(small())
    assert result.offloaded.computed_tokens < result.baseline.computed_tokens
    assert result.offloaded.computed_tokens >= result.minimum_compute


def test_control_store_before_compute_fails_integrity() -> None:
    result = run_demo(small(mutant="no-compute-barrier"))
    assert "store-after-compute" in result.offloaded.violations
    assert not result.outputs_identical
    assert not result.ok


def test_control_load_before_readers_fails_integrity() -> None:
    result = run_demo(small(mutant="no-write-after-read-wait"))
    assert "load-after-readers" in result.offloaded.violations
    assert not result.ok


def test_control_preemption_without_flush_fails_integrity() -> None:
    """Without the flush, a preempted request's stores read GPU blocks the engine reuses, and the verdict fails.
    Which check sees it depends on this workload's device schedule, which moves whenever the worker's grouping of
    copies does: wrong KV read by a request (the byte checks; with a step's loads sent together, e287265) or a
    store's read that ran after the reuse's write (an ordering invariant; with a step's stores sent as one
    pipeline). The interleavings and the explorer catch the mutant by name."""
    result = run_demo(small(mutant="no-preemption-flush"))
    assert result.poisoned or not result.outputs_identical or result.offloaded.violations
    assert not result.ok


def test_a_control_that_kvfsm_refuses_fails_integrity_without_a_traceback() -> None:
    """no-load-dedup pins a block already loading: the machine refuses, and the run ends as a failed verdict."""
    result = run_demo(DemoConfig(device=DeviceKind.cpu, mutant="no-load-dedup"))
    assert "refused" in result.offloaded.violations
    assert not result.ok


def test_unbounded_gpu_cache_computes_the_minimum() -> None:
    """The 'recomputed' figure is measured against `minimum_compute`; with room for everything none is recomputed."""
    result = run_demo(small(gpu_blocks=1000))
    assert result.baseline.computed_tokens == result.minimum_compute
    assert result.baseline.preemptions == 0


def test_exit_code_zero_when_integrity_holds() -> None:
    outcome = CliRunner().invoke(app, SMALL_ARGS)
    assert outcome.exit_code == 0, outcome.output
    assert "PASS" in outcome.output


def test_exit_code_one_when_integrity_fails() -> None:
    outcome = CliRunner().invoke(app, [*SMALL_ARGS, "--mutant", "no-compute-barrier"])
    assert outcome.exit_code == 1, outcome.output
    assert "FAIL" in outcome.output


def test_help_documents_the_knobs() -> None:
    outcome = CliRunner().invoke(app, ["--help"])
    assert outcome.exit_code == 0
    for knob in ("--conversations", "--turns", "--agents", "--gpu-blocks", "--cpu-blocks", "--block-size-factor",
                 "--eviction", "--device", "--seed"):
        assert knob in outcome.output


def test_request_larger_than_gpu_cache_is_refused() -> None:
    with pytest.raises(DemoConfigError, match="GPU blocks"):
        run_demo(small(gpu_blocks=4))
    outcome = CliRunner().invoke(app, [*SMALL_ARGS[:-1], "4"])
    assert outcome.exit_code == 2 and "GPU blocks" in outcome.output


def test_unknown_mutant_is_refused() -> None:
    with pytest.raises(DemoConfigError, match="unknown mutant"):
        small(mutant="no-such-rule")


def test_next_turn_resends_the_previous_prompt() -> None:
    arrivals = generate(SMALL, vocab=1000, seed=0)
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for arrival in sorted(arrivals, key=lambda a: int(a.request_id.rsplit("turn", 1)[1])):
        by_session.setdefault(arrival.request_id.rsplit("-", 1)[0], []).append(arrival.prompt)
    for prompts in by_session.values():
        for earlier, later in zip(prompts, prompts[1:]):
            assert later[:len(earlier)] == earlier and len(later) > len(earlier)


def test_agents_share_one_long_prefix() -> None:
    firsts = [a.prompt for a in generate(SMALL, vocab=1000, seed=0) if a.request_id.endswith("turn0")
              and a.request_id.startswith("agent")]
    assert len(firsts) == SMALL.agents
    assert len({p[:SMALL.shared_prefix_tokens] for p in firsts}) == 1


def test_arrivals_depend_only_on_the_seed() -> None:
    assert generate(SMALL, 1000, seed=3) == generate(SMALL, 1000, seed=3)
    assert generate(SMALL, 1000, seed=3) != generate(SMALL, 1000, seed=4)


def test_minimum_compute_counts_a_shared_block_once() -> None:
    arrivals = generate(WorkloadShape(conversations=0, turns=1, agents=2, shared_prefix_tokens=64), 1000, seed=0)
    alone = [minimum_compute([a], block_size=8) for a in arrivals]
    assert minimum_compute(arrivals, block_size=8) == sum(alone) - 64


def test_empty_workload_is_refused() -> None:
    with pytest.raises(WorkloadError):
        WorkloadShape(conversations=0, agents=0)


def test_with_a_disk_tier_prefixes_that_outgrow_cpu_are_served_from_disk(tmp_path: object) -> None:
    result = run_demo(small(cpu_blocks=16, disk=tmp_path))
    tiers = result.offloaded.tier_stats
    assert tiers is not None and tiers.tokens_loaded_from["disk"] > 0
    assert result.ok and result.offloaded.violations == {}
    assert list(tmp_path.iterdir()) == []  # type: ignore[attr-defined]  # the slot file is removed at exit


def test_disk_flag_shows_tokens_per_tier(tmp_path: object) -> None:
    outcome = CliRunner().invoke(app, [*SMALL_ARGS, "--disk", str(tmp_path), "--cpu-blocks", "16"])
    assert outcome.exit_code == 0, outcome.output
    assert "served from disk" in outcome.output and "PASS" in outcome.output


def test_control_a_disk_fetch_loaded_before_it_landed_fails_integrity(tmp_path: object) -> None:
    result = run_demo(small(cpu_blocks=16, disk=tmp_path, mutant="fetch-ready-early"))
    assert not result.ok



def _with_blocked(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """`code` run in a fresh interpreter in which importing any of `modules` fails, as where they are not installed."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in modules)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("missing", [("blake3",), ("mooncake", "blake3")])
def test_the_demo_loads_without_the_mooncake_extra(missing: tuple[str, ...]) -> None:
    """What a user installs without extras (CI's wheel check runs the demo so): the demo's imports reach the Mooncake
    tier and its controls, which must load without `blake3` or Mooncake."""
    outcome = _with_blocked(missing, "import kvfsm.demo.runs, kvfsm.tiers.mooncake")
    assert outcome.returncode == 0, outcome.stderr


def test_control_the_blocked_import_is_real_once_a_key_is_made() -> None:
    outcome = _with_blocked(("blake3",),
                            "from kvfsm.mooncake.secret import ValueKey\nValueKey.derive(bytes(32), None)")
    assert outcome.returncode != 0 and "import of blake3 halted" in outcome.stderr, outcome.stderr
