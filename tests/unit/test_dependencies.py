"""The dependencies keep to what was tested: pyproject.toml gives ranges with an upper bound,
constraints.txt pins every package in them at a version inside its range, and the
environment the suite runs in is that pinned set (scripts/env.sh installs it)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    return [Requirement(r) for r in [*project["dependencies"], *(r for e in extras for r in e)]]


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            out[canonicalize_name(name)] = Version(pinned)
    return out


def test_every_dependency_has_a_range_with_an_upper_bound():
    for r in requirements():
        operators = {s.operator for s in r.specifier}
        assert operators & {">=", "~="} and operators & {"<", "~="}, (
            f"{r}: give it a floor and an upper bound (see pyproject.toml)")


def test_constraints_pin_every_dependency_inside_its_range():
    pinned = pins()
    for r in requirements():
        name = canonicalize_name(r.name)
        assert name in pinned, f"{r.name} is not in constraints.txt: run scripts/lock.sh"
        assert r.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {r.name}=={pinned[name]}, outside {r.specifier}: "
            f"run scripts/lock.sh")


def test_the_suite_runs_on_the_pinned_versions():
    """Or, in scripts/test_latest.sh's environment (RAYLM_LATEST=1), on versions inside the
    ranges: the newest releases, which are not the lock's."""
    import os

    latest = os.environ.get("RAYLM_LATEST") == "1"
    pinned = pins()
    for r in requirements():
        name = canonicalize_name(r.name)
        try:
            installed = Version(version(r.name))
        except Exception:  # an extra that is not installed here (gpu)
            continue
        if latest:
            assert r.specifier.contains(installed.public, prereleases=True), (
                f"{r.name} {installed} is installed, outside {r.specifier}")
            continue
        # A local label (torch's +cpu build) is the same release.
        assert installed.public == str(pinned[name]), (
            f"{r.name} {installed} is installed, constraints.txt pins {pinned[name]}: "
            f"rebuild the environment (make env)")
