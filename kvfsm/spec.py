"""The lifecycle spec: pydantic models for `spec/*.yaml` and a loader that refuses what a typo could break.

The spec is the single source of truth: machines, transition tables, diagrams, generated tests and invariant
checks are all derived from what this module loads. A spec that loads is therefore a spec whose every name
means something: each state is declared once and reachable, each non-terminal state has a way out, each
ambiguous (state, trigger) pair is disambiguated by guards, and each guard, effect and invariant names a Python
predicate or action that exists.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_CHECKOUT = Path(__file__).resolve().parent.parent

CHECKOUT_SPEC_DIR = _CHECKOUT / "spec"
"""The lifecycles' single source of truth: `spec/` at the top of a source checkout (or an editable install of one)."""

PACKAGED_SPEC_DIR = Path(__file__).resolve().parent / "lifecycles"
"""Where a wheel puts the lifecycles: pyproject.toml maps the top-level `spec/` onto the data-only package
`kvfsm.lifecycles`, so an installed wheel carries the spec its machines are built from."""

DEFAULT_SPEC_DIR = (
    CHECKOUT_SPEC_DIR if (_CHECKOUT / "pyproject.toml").is_file() and CHECKOUT_SPEC_DIR.is_dir() else PACKAGED_SPEC_DIR
)
"""The spec loaded when none is named: the checkout's `spec/` where kvfsm runs from a source checkout (its
pyproject.toml beside it), so no leftover copy can stand in for the truth; else the copy the wheel installed (beside
an installed package, `../spec` is whatever else sits in site-packages)."""


class SpecError(ValueError):
    """A spec file is malformed; the message names the file, the lifecycle and the offending item."""

    def __init__(self, file: Path | str, lifecycle: str | None, item: str, problem: str) -> None:
        self.file = str(file)
        self.lifecycle = lifecycle
        self.item = item
        self.problem = problem
        where = f"{self.file}" + (f", lifecycle {lifecycle!r}" if lifecycle else "")
        super().__init__(f"{where}, {item}: {problem}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Coupling(_Strict):
    """A trigger this transition fires on other objects: `fire` on each `target` model the relation `of` names.

    Couplings are how one lifecycle moves another (a store's completion makes its CPU slots ready, unfences its GPU
    blocks and tells its request); they run after the transition's own effects, each target through its own
    machine, so a coupling the target's state refuses raises there as any illegal trigger does.
    """

    fire: str = Field(min_length=1)
    lifecycle: str = Field(alias="target", min_length=1)
    relation: str = Field(alias="of", min_length=1)

    def __str__(self) -> str:
        return f"{self.lifecycle}.{self.fire}({self.relation})"


class Transition(_Strict):
    """One edge family: `trigger` moves a model from any of `source` to `dest` when every guard holds."""

    trigger: str = Field(min_length=1)
    source: tuple[str, ...]
    dest: str = Field(min_length=1)
    guards: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    couplings: tuple[Coupling, ...] = ()

    @field_validator("source", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value


class Lifecycle(_Strict):
    """A lifecycle as declared in one YAML file."""

    name: str = Field(alias="lifecycle", min_length=1)
    description: str
    initial: str
    terminal: tuple[str, ...] = ()
    states: dict[str, str]
    transitions: tuple[Transition, ...]
    invariants: dict[str, str] = {}

    @property
    def triggers(self) -> tuple[str, ...]:
        """Triggers in order of first declaration."""
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    def branches(self, state: str, trigger: str) -> tuple[Transition, ...]:
        """The transitions `trigger` may take from `state`, in declaration order (the order guards are tried)."""
        return tuple(t for t in self.transitions if t.trigger == trigger and state in t.source)


class Spec(_Strict):
    """Every lifecycle of the system, keyed by name."""

    lifecycles: dict[str, Lifecycle]
    files: dict[str, str]

    def __getitem__(self, name: str) -> Lifecycle:
        return self.lifecycles[name]

    @property
    def invariants(self) -> dict[str, str]:
        return {k: v for lc in self.lifecycles.values() for k, v in lc.invariants.items()}


class Registry(Protocol):
    """Where the names a spec uses must be defined (`kvfsm.registry.Registry` is the one kvfsm ships)."""

    def has_guard(self, lifecycle: str, name: str) -> bool: ...
    def has_effect(self, lifecycle: str, name: str) -> bool: ...
    def has_invariant(self, name: str) -> bool: ...
    def has_relation(self, lifecycle: str, name: str) -> bool: ...


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML silently keeps the last of two equal keys; a duplicated state would vanish. Refuse it instead."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def load_lifecycle(path: Path, registry: Registry | None = None) -> Lifecycle:
    """Parse and validate one lifecycle file."""
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise SpecError(path, None, "YAML", str(err).replace("\n", " ")) from err
    name = raw.get("lifecycle") if isinstance(raw, dict) else None
    try:
        lifecycle = Lifecycle.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        item = ".".join(str(p) for p in first["loc"]) or "document"
        raise SpecError(path, name, item, first["msg"]) from err
    if path.stem != lifecycle.name:
        raise SpecError(path, lifecycle.name, "lifecycle", f"file must be named {lifecycle.name}.yaml")
    _check_graph(path, lifecycle)
    if registry is not None:
        _check_names(path, lifecycle, registry)
    return lifecycle


def load_spec(directory: Path | str = DEFAULT_SPEC_DIR, *, registry: Registry) -> Spec:
    """Load every `*.yaml` lifecycle in `directory`, each guard, effect and invariant name checked against `registry`.

    The registry is handed in rather than imported, so the spec knows no runtime: `kvfsm.bindings.default_spec()`
    is the shipped spec checked against the bindings kvfsm ships.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecError(directory, None, "directory", "does not exist or is not a folder; legal: a folder of *.yaml")
    for name in ("has_guard", "has_effect", "has_invariant"):
        if not callable(getattr(registry, name, None)):
            raise TypeError(f"load_spec: registry must provide {name}() (see kvfsm.registry.Registry)")
    paths = sorted(directory.glob("*.yaml"))
    if not paths:
        raise SpecError(directory, None, "directory", "holds no *.yaml lifecycle file")
    lifecycles: dict[str, Lifecycle] = {}
    files: dict[str, str] = {}
    invariant_owner: dict[str, str] = {}
    for path in paths:
        lifecycle = load_lifecycle(path, registry)
        if lifecycle.name in lifecycles:
            raise SpecError(path, lifecycle.name, "lifecycle", f"declared twice (also in {files[lifecycle.name]})")
        for invariant in lifecycle.invariants:
            if invariant in invariant_owner:
                raise SpecError(
                    path, lifecycle.name, f"invariant {invariant!r}",
                    f"already declared by lifecycle {invariant_owner[invariant]!r}",
                )
            invariant_owner[invariant] = lifecycle.name
        lifecycles[lifecycle.name] = lifecycle
        files[lifecycle.name] = str(path)
    for lifecycle in lifecycles.values():
        _check_couplings(Path(files[lifecycle.name]), lifecycle, lifecycles, registry)
    return Spec(lifecycles=lifecycles, files=files)


def _check_couplings(path: Path, lc: Lifecycle, lifecycles: dict[str, Lifecycle], registry: Registry) -> None:
    """Each coupling names a lifecycle of the spec, one of its triggers, and a relation the registry resolves."""
    for index, t in enumerate(lc.transitions):
        item = f"transition #{index + 1} ({t.trigger})"
        for coupling in t.couplings:
            target = lifecycles.get(coupling.lifecycle)
            if target is None:
                raise SpecError(path, lc.name, item, f"coupling names unknown lifecycle {coupling.lifecycle!r}")
            if coupling.fire not in target.triggers:
                raise SpecError(path, lc.name, item,
                                f"coupling fires {coupling.fire!r}, which lifecycle {target.name!r} does not have")
            if not registry.has_relation(lc.name, coupling.relation):
                raise SpecError(path, lc.name, item,
                                f"coupling relation {coupling.relation!r} is not defined in the relation registry")


def _check_graph(path: Path, lc: Lifecycle) -> None:
    def fail(item: str, problem: str) -> None:
        raise SpecError(path, lc.name, item, problem)

    states = set(lc.states)
    if lc.initial not in states:
        fail("initial", f"unknown state {lc.initial!r}")
    for state in lc.terminal:
        if state not in states:
            fail("terminal", f"unknown state {state!r}")
    for index, t in enumerate(lc.transitions):
        item = f"transition #{index + 1} ({t.trigger})"
        for state in (*t.source, t.dest):
            if state not in states:
                fail(item, f"unknown state {state!r}")
        if len(set(t.source)) != len(t.source):
            fail(item, "lists a source state twice")
        for state in t.source:
            if state in lc.terminal:
                fail(item, f"leaves terminal state {state!r}")
    for state in lc.states:
        for trigger in lc.triggers:
            branches = lc.branches(state, trigger)
            if len(branches) > 1 and any(not b.guards for b in branches):
                dests = ", ".join(sorted({b.dest for b in branches}))
                fail(
                    f"state {state!r} trigger {trigger!r}",
                    f"has {len(branches)} transitions (to {dests}) and not every one has a guard to choose",
                )
    reached = {lc.initial}
    frontier = deque([lc.initial])
    while frontier:
        state = frontier.popleft()
        for t in lc.transitions:
            if state in t.source and t.dest not in reached:
                reached.add(t.dest)
                frontier.append(t.dest)
    for state in lc.states:
        if state not in reached:
            fail(f"state {state!r}", f"is unreachable from the initial state {lc.initial!r}")
        leaves = any(state in t.source and t.dest != state for t in lc.transitions)
        if state not in lc.terminal and not leaves:
            fail(f"state {state!r}", "is a dead end: not terminal, and no transition leaves it")


def _check_names(path: Path, lc: Lifecycle, registry: Registry) -> None:
    for index, t in enumerate(lc.transitions):
        item = f"transition #{index + 1} ({t.trigger})"
        for guard in t.guards:
            if not registry.has_guard(lc.name, guard):
                raise SpecError(path, lc.name, item, f"guard {guard!r} is not defined in the guard registry")
        for effect in t.effects:
            if not registry.has_effect(lc.name, effect):
                raise SpecError(path, lc.name, item, f"effect {effect!r} is not defined in the effect registry")
    for invariant in lc.invariants:
        if not registry.has_invariant(invariant):
            raise SpecError(
                path, lc.name, f"invariant {invariant!r}", "is not defined in the invariant registry"
            )
