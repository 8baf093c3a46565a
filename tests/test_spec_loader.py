"""The loader reads the top-level `spec/` a wheel also carries, and refuses every kind of broken spec, each with an
error naming the file, the lifecycle and the item."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import yaml

from kvfsm.bindings import default_registry, default_spec
from kvfsm.spec import DEFAULT_SPEC_DIR, SpecError, load_spec

Doc = dict
REPO = Path(__file__).resolve().parents[1]
PACKAGED = "kvfsm/lifecycles/"
"""Where pyproject.toml puts `spec/` inside the wheel: the data-only package `kvfsm.lifecycles`."""


def broken_spec(tmp_path: Path, lifecycle: str, mutate: Callable[[Doc], None]) -> Path:
    """A copy of the shipped spec with one lifecycle file mutated."""
    spec_dir = tmp_path / "spec"
    shutil.copytree(DEFAULT_SPEC_DIR, spec_dir)
    path = spec_dir / f"{lifecycle}.yaml"
    doc = yaml.safe_load(path.read_text())
    mutate(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return spec_dir


def refusal(spec_dir: Path, lifecycle: str, *fragments: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        load_spec(spec_dir, registry=default_registry())
    message = str(caught.value)
    assert f"{lifecycle}.yaml" in message and repr(lifecycle) in message
    for fragment in fragments:
        assert fragment in message, message
    return caught.value


def test_shipped_spec_loads_with_the_states_the_design_card_names() -> None:
    spec = default_spec()
    assert {"pending-store", "submitted", "loading", "ready"} <= set(spec["cpu-block"].states)
    assert {"pending-store", "submitted", "flushed-on-preempt", "done", "failed"} <= set(spec["transfer-job"].states)
    assert {"new", "deferred", "loading", "running", "preempted", "draining", "released"} <= set(spec["request"].states)


# --- where the spec lives: `spec/` in the checkout, the same files inside the wheel --------------------------------


def test_the_default_spec_is_read_from_the_top_level_spec_folder_of_the_checkout() -> None:
    assert DEFAULT_SPEC_DIR == REPO / "spec"
    assert {Path(f).parent for f in default_spec().files.values()} == {REPO / "spec"}


def _wheel(tmp: Path, drop_from_pyproject: str = "") -> zipfile.ZipFile:
    """A wheel built from a copy of the checkout's packaging inputs (so no stale `build/` of the tree leaks in),
    without network: the running environment's setuptools builds it. `drop_from_pyproject` removes one line."""
    src = tmp / "src"
    for name in ("kvfsm", "spec"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "README.md", src)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert drop_from_pyproject in pyproject
    (src / "pyproject.toml").write_text(pyproject.replace(drop_from_pyproject, ""))
    out = tmp / "wheel"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(out), str(src)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("kvfsm-*.whl")
    return zipfile.ZipFile(wheel)


def _packaged_spec(wheel: zipfile.ZipFile) -> dict[str, bytes]:
    return {name.removeprefix(PACKAGED): wheel.read(name) for name in wheel.namelist() if name.startswith(PACKAGED)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return _wheel(tmp_path_factory.mktemp("wheel"))


def test_a_built_wheel_carries_the_same_spec_files_as_the_top_level_spec_folder(wheel: zipfile.ZipFile) -> None:
    assert _packaged_spec(wheel) == {p.name: p.read_bytes() for p in (REPO / "spec").glob("*.yaml")}


def test_a_built_wheel_carries_every_kvfsm_package(wheel: zipfile.ZipFile) -> None:
    """pyproject.toml lists the packages by hand (a folder mapped into the package is one `find` cannot see)."""
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "kvfsm").rglob("__init__.py")}
    assert on_disk <= set(wheel.namelist())


def test_control_a_wheel_without_the_spec_as_package_data_carries_no_spec(tmp_path: Path) -> None:
    """The check above can fail: drop the line shipping the YAML and the wheel's copy of the spec is empty."""
    assert _packaged_spec(_wheel(tmp_path, drop_from_pyproject='"kvfsm.lifecycles" = ["*.yaml"]')) == {}


def test_unknown_destination_state_is_refused(tmp_path: Path) -> None:
    spec_dir = broken_spec(tmp_path, "cpu-block", lambda d: d["transitions"][0].update(dest="redy"))
    refusal(spec_dir, "cpu-block", "transition #1 (allocate)", "unknown state 'redy'")


def test_unknown_initial_state_is_refused(tmp_path: Path) -> None:
    spec_dir = broken_spec(tmp_path, "request", lambda d: d.update(initial="fresh"))
    refusal(spec_dir, "request", "initial", "unknown state 'fresh'")


def test_duplicate_state_is_refused(tmp_path: Path) -> None:
    spec_dir = tmp_path / "spec"
    shutil.copytree(DEFAULT_SPEC_DIR, spec_dir)
    path = spec_dir / "gpu-block.yaml"
    path.write_text(path.read_text().replace("  fenced:", "  writable: again.\n  fenced:", 1))
    with pytest.raises(SpecError, match=r"gpu-block\.yaml.*YAML.*duplicate key 'writable'"):
        load_spec(spec_dir, registry=default_registry())


def test_unreachable_state_is_refused(tmp_path: Path) -> None:
    def add_island(doc: Doc) -> None:
        doc["states"]["limbo"] = "nothing leads here."
        doc["transitions"].append({"trigger": "escape", "source": "limbo", "dest": "free"})

    refusal(broken_spec(tmp_path, "cpu-block", add_island), "cpu-block", "state 'limbo'", "unreachable")


def test_non_terminal_dead_end_is_refused(tmp_path: Path) -> None:
    def drop_exits(doc: Doc) -> None:
        doc["transitions"] = [t for t in doc["transitions"] if t["source"] != "draining"]

    refusal(broken_spec(tmp_path, "request", drop_exits), "request", "state 'draining'", "dead end")


def test_transition_out_of_a_terminal_state_is_refused(tmp_path: Path) -> None:
    def revive(doc: Doc) -> None:
        doc["transitions"].append({"trigger": "revive", "source": "done", "dest": "submitted"})

    refusal(broken_spec(tmp_path, "transfer-job", revive), "transfer-job", "(revive)", "leaves terminal state 'done'")


def test_two_destinations_without_a_guard_are_refused(tmp_path: Path) -> None:
    def unguard(doc: Doc) -> None:
        for t in doc["transitions"]:
            if t["trigger"] == "unfence" and t["dest"] == "writable":
                del t["guards"]

    refusal(broken_spec(tmp_path, "gpu-block", unguard), "gpu-block", "state 'fenced' trigger 'unfence'",
            "not every one has a guard")


@pytest.mark.parametrize(
    ("kind", "mutate", "fragment"),
    [
        ("guard", lambda d: d["transitions"][0].update(guards=["has-free-slot"]), "guard 'has-free-slot'"),
        ("effect", lambda d: d["transitions"][0].update(effects=["claim-hashes"]), "effect 'claim-hashes'"),
        ("invariant", lambda d: d["invariants"].update({"readers-pinn": "typo."}), "invariant 'readers-pinn'"),
    ],
)
def test_unbound_name_is_refused(tmp_path: Path, kind: str, mutate: Callable[[Doc], None], fragment: str) -> None:
    refusal(broken_spec(tmp_path, "cpu-block", mutate), "cpu-block", fragment, f"not defined in the {kind} registry")


def test_misspelt_field_is_refused(tmp_path: Path) -> None:
    spec_dir = broken_spec(tmp_path, "transfer-job", lambda d: d["transitions"][0].update(gaurds=["is-store"]))
    refusal(spec_dir, "transfer-job", "transitions.0.gaurds", "Extra inputs are not permitted")


def test_file_named_after_another_lifecycle_is_refused(tmp_path: Path) -> None:
    spec_dir = broken_spec(tmp_path, "gpu-block", lambda d: d.update(lifecycle="gpu-blocks"))
    with pytest.raises(SpecError, match=r"gpu-block\.yaml.*'gpu-blocks'.*must be named gpu-blocks\.yaml"):
        load_spec(spec_dir, registry=default_registry())


def test_invariant_declared_by_two_lifecycles_is_refused(tmp_path: Path) -> None:
    spec_dir = broken_spec(tmp_path, "gpu-block", lambda d: d["invariants"].update({"fence": "again."}))
    # gpu-block.yaml loads first, so the later file is the one refused.
    refusal(spec_dir, "transfer-job", "invariant 'fence'", "already declared by lifecycle 'gpu-block'")


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist or is not a folder"):
        load_spec(tmp_path / "nowhere", registry=default_registry())


def test_a_registry_without_the_lookups_is_refused() -> None:
    with pytest.raises(TypeError, match="registry must provide has_guard"):
        load_spec(DEFAULT_SPEC_DIR, registry=object())  # type: ignore[arg-type]


def test_empty_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no \\*.yaml lifecycle file"):
        load_spec(tmp_path, registry=default_registry())


def _couple(coupling: dict[str, str]) -> Callable[[Doc], None]:
    def edit(doc: Doc) -> None:
        doc["transitions"][0].setdefault("couplings", []).append(coupling)

    return edit


def test_a_coupling_to_an_unknown_lifecycle_is_refused(tmp_path: Path) -> None:
    spec = broken_spec(tmp_path, "transfer-job", _couple({"fire": "fence", "target": "gpu-blok", "of": "gpu-blocks"}))
    refusal(spec, "transfer-job", "(prepare)", "unknown lifecycle 'gpu-blok'")


def test_a_coupling_firing_a_trigger_its_target_lacks_is_refused(tmp_path: Path) -> None:
    spec = broken_spec(tmp_path, "transfer-job", _couple({"fire": "fenc", "target": "gpu-block", "of": "gpu-blocks"}))
    refusal(spec, "transfer-job", "(prepare)", "fires 'fenc'", "'gpu-block' does not have")


def test_a_coupling_over_an_unregistered_relation_is_refused(tmp_path: Path) -> None:
    spec = broken_spec(tmp_path, "transfer-job", _couple({"fire": "fence", "target": "gpu-block", "of": "gpu-blokcs"}))
    refusal(spec, "transfer-job", "(prepare)", "relation 'gpu-blokcs' is not defined")
