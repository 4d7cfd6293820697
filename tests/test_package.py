"""The package: its public names survive importing every one of its modules."""

from __future__ import annotations

import importlib
import pkgutil
import types

import django_awa as awa


def _submodules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(awa.__path__, prefix="django_awa.")
        if ".migrations." not in info.name
    ]


def test_no_module_of_the_package_shadows_a_public_name() -> None:
    # Importing django_awa.X binds the package attribute X to that module: a
    # module named like a public name (awa.worker, awa.enqueue...) would then
    # replace it for everyone, and `@awa.worker(...)` in a jobs.py imported
    # later fails with "'module' object is not callable".
    before = {name: getattr(awa, name) for name in awa.__all__}
    names = _submodules()
    for name in names:
        importlib.import_module(name)

    rebound = [name for name in awa.__all__ if getattr(awa, name) is not before[name]]
    assert not rebound, f"importing the modules rebound: {rebound}"
    clashes = sorted(set(awa.__all__) & {name.split(".")[1] for name in names})
    assert not clashes, f"modules named like public names: {clashes}"
    # Also when some module was imported before this test ran (by another test).
    for name in awa.__all__:
        value = getattr(awa, name)
        assert not isinstance(value, types.ModuleType), f"awa.{name} is a module"
        home = importlib.import_module(f"django_awa.{awa._EXPORTS[name]}")
        assert value is getattr(home, name), f"awa.{name} is not {home.__name__}.{name}"


def test_the_version_has_one_source_and_the_changelog_agrees() -> None:
    # pyproject.toml reads the version from django_awa.__version__ (setuptools attr:),
    # and writes it nowhere else.
    import re
    import tomllib
    from pathlib import Path

    from packaging.version import Version

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml hard-codes a version"
    assert project["project"]["dynamic"] == ["version"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "django_awa.__version__"}

    version = Version(awa.__version__)  # a valid PEP 440 version
    heading = next(
        line for line in (root / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")
    )
    match = re.fullmatch(r"## (\S+)(?: \((unreleased|\d{4}-\d{2}-\d{2})\))?", heading)
    assert match, f"CHANGELOG.md's newest heading {heading!r} is not '## X.Y.Z (date|unreleased)'"
    assert Version(match[1]) == Version(version.base_version), (
        f"CHANGELOG.md's newest section is {match[1]}, django_awa.__version__ is {version}"
    )
    # A development version is unreleased; a release has its date.
    assert (match[2] == "unreleased") == version.is_devrelease, (heading, str(version))


def test_the_classifiers_are_ones_pypi_accepts_and_name_the_supported_versions() -> None:
    import tomllib
    from pathlib import Path

    from trove_classifiers import classifiers as known

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    unknown = [c for c in project["classifiers"] if c not in known]
    assert not unknown, f"PyPI refuses unknown classifiers: {unknown}"
    assert "Framework :: Django" in project["classifiers"]
    for python in ("3.12", "3.13"):
        assert f"Programming Language :: Python :: {python}" in project["classifiers"]
    assert project["requires-python"] == ">=3.12"
