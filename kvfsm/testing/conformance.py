"""The eviction-policy conformance suite: `python -m kvfsm.testing.conformance package.module:MyPolicy`.

Any policy, built-in or a user's, must keep the contract of `kvfsm.manager.policies.base`. The suite runs the
manager's generated state machine (`kvfsm.testing.manager_calls`) with the policy behind a probe that checks every
answer it gives, then the exhaustive explorer's small workloads (`kvfsm.testing.explorer`) with a whole connector
using it. Each rule below is named in the report; a broken one comes with the shortest call sequence hypothesis
found. `--controls` runs the suite on the deliberately unsafe policies of `kvfsm.testing.policy_controls` and
fails unless each is caught by the rule it breaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import typer
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from rich.console import Console
from rich.table import Table

from kvfsm.manager import (
    Evictable,
    EvictionPolicy,
    NotAnEvictionPolicy,
    OffloadingManager,
    UnknownEvictionPolicy,
    policy_class,
)
from kvfsm.testing.explorer import explore
from kvfsm.testing.explorer_workloads import POLICY_WORKLOADS
from kvfsm.testing.manager_calls import manager_machine, policy_state
from kvfsm.testing.policy_controls import CONTROLS

RULES: dict[str, str] = {
    "victims-exact": "victims answers n distinct slots or None: never evicts more (or fewer) than asked",
    "victims-held": "every victim is a slot the policy holds",
    "victims-offered": "every victim is one the manager offered: never a pinned, loading, storing, written-back, "
                       "unpublished or planned block",
    "victims-a-question": "victims changes nothing and answers the same when asked again",
    "victims-none-only-when-short": "None only when fewer than n offered slots are held",
    "holds-readable": "the policy holds exactly the readable slots, at most the pool's size, none after a reset",
    "manager-invariants": "the manager's state machine keeps the spec's and the catalogue's invariants (pins, "
                          "ready bytes, pool accounting, events, refusals that change nothing, no leaked slot)",
    "explorer": "every schedule of the explorer's small workloads keeps the spec with a connector using the policy",
}
MACHINE_RULES = tuple(rule for rule in RULES if rule != "explorer")
POOLS = (3, 7)
"""Pool sizes the state machine runs at: one where nearly every store evicts or is refused, one roomier."""


class Probe(EvictionPolicy):
    """The policy under test, every `victims` answer checked against the contract as the manager receives it."""

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity)
        self.inner = inner

    def insert(self, slot: int, block_hash: int) -> None:
        self.inner.insert(slot, block_hash)

    def touch(self, slot: int) -> None:
        self.inner.touch(slot)

    def insert_many(self, stored: object) -> None:
        self.inner.insert_many(stored)  # type: ignore[arg-type]

    def touch_many(self, slots: object) -> None:
        self.inner.touch_many(slots)  # type: ignore[arg-type]

    def remove(self, slot: int) -> None:
        self.inner.remove(slot)

    def clear(self) -> None:
        self.inner.clear()

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, slot: object) -> bool:
        return slot in self.inner

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        inner = self.inner
        before = policy_state(inner)
        answer = inner.victims(n, evictable)
        asked = f"victims({n}) answered {answer}"
        assert policy_state(inner) == before, f"victims-a-question: {asked} and changed the policy's state"
        assert inner.victims(n, evictable) == answer, f"victims-a-question: {asked}, then something else"
        if answer is None:
            offered = [slot for slot in range(self.capacity) if slot in inner and evictable(slot)]
            assert len(offered) < n, f"victims-none-only-when-short: {asked} with {offered} offered"
            return None
        assert len(answer) == len(set(answer)) == n, f"victims-exact: {asked}"
        assert all(slot in inner for slot in answer), f"victims-held: {asked}, not all held"
        refused = [slot for slot in answer if not evictable(slot)]
        assert not refused, f"victims-offered: {asked}; {refused} were not offered"
        return answer


@dataclass(frozen=True)
class Verdict:
    rule: str
    outcome: str  # "pass", "FAIL" or "not reached" (an earlier rule failed first)
    detail: str = ""


def _import_path(policy: type[EvictionPolicy]) -> str:
    return f"{policy.__module__}:{policy.__qualname__}"


def run_machine(policy: type[EvictionPolicy], examples: int) -> tuple[str, str] | None:
    """The first rule the state machine finds broken, with what broke it; None when every run kept them all."""
    budget = settings(max_examples=examples, phases=[Phase.generate, Phase.shrink], database=None,
                      derandomize=True, deadline=None, report_multiple_bugs=False,
                      suppress_health_check=list(HealthCheck))
    for pool in POOLS:
        machine = manager_machine(lambda n: OffloadingManager(n, Probe(policy(n))), pool=pool)
        try:
            run_state_machine_as_test(machine, settings=budget)
        except Exception as error:  # a policy that raises breaks the manager's run: a finding, not a crash
            message = f"{type(error).__name__}: {error}" if not isinstance(error, AssertionError) else str(error)
            rule, _, detail = message.partition(": ")
            steps = "\n".join(getattr(error, "__notes__", ()))
            if rule not in RULES:
                rule, detail = "manager-invariants", message
            return rule, f"pool of {pool}: {detail}\n{steps}".strip()
    return None


def run_explorer(policy: type[EvictionPolicy]) -> str | None:
    """What the first violating schedule broke, or None when every schedule of every workload kept the spec."""
    for name, workload in POLICY_WORKLOADS.items():
        workload = dataclasses.replace(workload, eviction=_import_path(policy))
        result = explore(workload)
        if not result.clean:
            return f"{name}: {result.violation[0]} after {list(result.counterexample)}"
        if not result.exhausted:
            return f"{name}: the state budget cut the search short after {result.states} states"
    return None


def conform(policy: str | type[EvictionPolicy], examples: int = 200, explorer: bool = True) -> list[Verdict]:
    """Every rule's verdict for `policy` (an import path, a built-in's name, or the class)."""
    cls = policy_class(policy) if isinstance(policy, str) else policy
    broken = run_machine(cls, examples)
    verdicts = [Verdict(rule, "pass") for rule in MACHINE_RULES] if broken is None else [
        Verdict(rule, "FAIL", broken[1]) if rule == broken[0] else Verdict(rule, "not reached")
        for rule in MACHINE_RULES]
    if not explorer:
        return verdicts + [Verdict("explorer", "not reached", "--no-explore")]
    if broken is not None:
        return verdicts + [Verdict("explorer", "not reached")]
    found = run_explorer(cls)
    return verdicts + [Verdict("explorer", "pass" if found is None else "FAIL", found or "")]


def failed(verdicts: Sequence[Verdict]) -> list[str]:
    return [v.rule for v in verdicts if v.outcome == "FAIL"]


app = typer.Typer(add_completion=False, help=__doc__)
console = Console(width=130)


def _report(title: str, verdicts: Sequence[Verdict]) -> None:
    table = Table(title=title)
    for column in ("rule", "verdict", "what it checks / what broke it"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        style = {"pass": "green", "FAIL": "bold red"}.get(v.outcome, "yellow")
        table.add_row(v.rule, f"[{style}]{v.outcome}[/{style}]", v.detail or RULES[v.rule])
    console.print(table)


@app.command()
def main(policy: str = typer.Argument("", help="the policy: package.module:ClassName, or a built-in's name"),
         examples: int = typer.Option(200, min=1, help="generated call sequences per pool size"),
         explore_schedules: bool = typer.Option(True, "--explore/--no-explore",
                                                help="also explore every schedule of a small workload (about 20 s)"),
         controls: bool = typer.Option(False, "--controls", help="check that every unsafe control is caught")) -> None:
    """Check an eviction policy against the manager's contract; exit status 1 when a rule is broken."""
    if controls:
        missed = []
        for rule, control in CONTROLS.items():
            verdicts = conform(control, examples, explorer=False)
            _report(f"control {control.__name__} (breaks {rule})", verdicts)
            if failed(verdicts) != [rule]:
                missed.append(rule)
        if missed:
            console.print(f"[bold red]controls not caught by their rule[/bold red]: {', '.join(missed)}")
            raise typer.Exit(1)
        return
    if not policy:
        raise typer.BadParameter("name a policy (package.module:ClassName or a built-in), or pass --controls",
                                 param_hint="POLICY")
    try:
        verdicts = conform(policy, examples, explore_schedules)
    except (UnknownEvictionPolicy, NotAnEvictionPolicy) as refused:
        raise typer.BadParameter(str(refused), param_hint="POLICY") from refused
    _report(f"eviction policy {policy}", verdicts)
    if failed(verdicts):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
