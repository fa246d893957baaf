"""The dependency lower bounds in pyproject.toml are the versions uv.lock pins (and CI tests)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _locked_versions() -> dict[str, Version]:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    return {package["name"]: Version(package["version"]) for package in lock["package"]}


def _direct_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    texts = [*project["project"]["dependencies"], *project["dependency-groups"]["dev"]]
    return [Requirement(text) for text in texts]


def test_lower_bounds_are_the_tested_minor_releases() -> None:
    """Each direct dependency has a >= bound at the locked major.minor: an older release that
    CI never ran (e.g. transformers>=4.57 while 5.x is tested) is not claimed to work."""
    locked = _locked_versions()
    for requirement in _direct_requirements():
        name = requirement.name.lower().replace("_", "-")
        bounds = [spec for spec in requirement.specifier if spec.operator == ">="]
        assert bounds, f"{requirement} has no lower bound"
        lower, tested = Version(bounds[0].version), locked[name]
        assert requirement.specifier.contains(tested), f"{requirement} excludes locked {tested}"
        assert (lower.major, lower.minor) == (tested.major, tested.minor), (
            f"{requirement}: lower bound {lower} is not the tested {tested.major}.{tested.minor}"
        )
