"""The eviction-policy conformance suite: every built-in keeps every rule, and each rule catches the control that
breaks it (`kvfsm.testing.policy_controls`), named as that rule, through the one command a user runs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvfsm.manager.policies import BUILTIN
from kvfsm.testing import conformance
from kvfsm.testing.conformance import MACHINE_RULES, RULES, conform, failed, run_explorer
from kvfsm.testing.policy_controls import CONTROLS, IgnoresPins

BUILTINS = sorted(set(BUILTIN) - {"w-tinylfu"})  # w-tinylfu is tinylfu
EXAMPLES = 60


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_keeps_every_rule_of_the_manager_state_machine(name: str) -> None:
    verdicts = conform(name, EXAMPLES, explorer=False)
    assert failed(verdicts) == [], [v for v in verdicts if v.outcome == "FAIL"]
    assert [v.rule for v in verdicts if v.outcome == "pass"] == list(MACHINE_RULES)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_keeps_the_spec_in_every_explored_schedule(name: str) -> None:
    assert run_explorer(BUILTIN[name]) is None


@pytest.mark.parametrize("rule", sorted(CONTROLS))
def test_control_breaking_the_rule_is_caught_by_that_rule(rule: str) -> None:
    verdicts = conform(CONTROLS[rule], EXAMPLES, explorer=False)
    assert failed(verdicts) == [rule], [(v.rule, v.outcome, v.detail[:200]) for v in verdicts]


def test_every_machine_rule_has_a_control() -> None:
    assert set(CONTROLS) | {"manager-invariants"} == set(MACHINE_RULES)


def test_explorer_catches_a_policy_that_may_evict_a_block_being_loaded() -> None:
    found = run_explorer(IgnoresPins)
    assert found is not None and "PolicyViolation" in found, found


def test_one_command_reports_a_broken_rule_by_name_and_exits_1() -> None:
    path = "kvfsm.testing.policy_controls:IgnoresPins"
    result = CliRunner().invoke(conformance.app, [path, "--no-explore", "--examples", str(EXAMPLES)])
    assert result.exit_code == 1, result.output
    assert "victims-offered" in result.output and "FAIL" in result.output


def test_one_command_passes_a_builtin_and_exits_0() -> None:
    result = CliRunner().invoke(conformance.app, ["lru", "--no-explore", "--examples", "20"])
    assert result.exit_code == 0, result.output
    assert all(rule in result.output for rule in MACHINE_RULES)


@pytest.mark.parametrize(("policy", "why"), [
    ("no_such_module:Policy", "cannot be imported"),
    ("kvfsm.manager:Lookup", "legal: a subclass of kvfsm.manager.EvictionPolicy"),
    ("fifo", "unknown eviction policy 'fifo'"),
])
def test_one_command_refuses_what_is_no_policy_naming_why(policy: str, why: str) -> None:
    result = CliRunner().invoke(conformance.app, [policy, "--no-explore"])
    assert result.exit_code == 2 and why in " ".join(result.output.replace("│", " ").split()), result.output


def test_every_rule_is_described() -> None:
    assert all(RULES[rule] for rule in RULES)


def test_the_controls_switch_shows_every_control_caught_by_its_own_rule() -> None:
    result = CliRunner().invoke(conformance.app, ["--controls", "--examples", str(EXAMPLES)])
    assert result.exit_code == 0, result.output
    assert all(f"(breaks {rule})" in result.output for rule in CONTROLS)
