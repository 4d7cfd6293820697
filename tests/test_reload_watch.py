"""The ``--reload`` watcher's look at the project's files while the worker is down
(``reloader._Tree``), in this process: what it sees, and what it lists again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from django_awa.reloader import _Tree


def _age(root: Path, seconds: float = 60.0) -> None:
    """Every file and directory under ``root`` last changed ``seconds`` ago."""
    stamp = time.time() - seconds
    for here, subdirectories, names in os.walk(root):
        for name in [*subdirectories, *names]:
            os.utime(Path(here) / name, (stamp, stamp))
    os.utime(root, (stamp, stamp))


def _touch(path: Path, text: str = "") -> None:
    """Write ``path`` in place (its directory's time stays as it was), newer than before."""
    path.write_text(text)
    os.utime(path, (time.time(), time.time()))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    for package in ("shop", "shop/orders", "data/a", "data/b", ".git", "node_modules"):
        (tmp_path / package).mkdir(parents=True)
    for module in ("manage.py", "shop/jobs.py", "shop/orders/models.py", ".git/x.py"):
        (tmp_path / module).write_text("")
    (tmp_path / "node_modules" / "y.py").write_text("")
    for i in range(50):
        (tmp_path / "data" / "a" / f"{i}.json").write_text("{}")
    _age(tmp_path)
    return tmp_path


def _changed(before: dict[Path, float], after: dict[Path, float]) -> list[Path]:
    """As the watcher judges: a file that appeared, or one newer than before."""
    return sorted(p for p, mtime in after.items() if p not in before or mtime > before[p])


def test_the_project_files_are_found_outside_hidden_and_package_directories(project):
    found = _Tree({(project, True)}).snapshot()
    assert sorted(p.relative_to(project).as_posix() for p in found) == [
        "manage.py",
        "shop/jobs.py",
        "shop/orders/models.py",
    ]


def test_a_file_edited_in_place_is_seen_without_listing_its_directory_again(project):
    tree = _Tree({(project, True)})
    seen = tree.snapshot()
    listed = dict(tree.listings)
    _touch(project / "shop" / "orders" / "models.py", "x = 1\n")
    assert _changed(seen, tree.snapshot()) == [project / "shop" / "orders" / "models.py"]
    # No directory changed: each listing is the one the first look made.
    assert all(tree.listings[d] is listing for d, listing in listed.items())
    assert set(tree.listings) == set(listed)


def test_a_file_added_in_a_new_directory_is_seen_at_the_next_look(project):
    tree = _Tree({(project, True)})
    seen = tree.snapshot()
    (project / "shop" / "payments").mkdir()
    (project / "shop" / "payments" / "jobs.py").write_text("")
    (project / "data" / "a" / "later.py").write_text("")
    assert _changed(seen, tree.snapshot()) == [
        project / "data" / "a" / "later.py",
        project / "shop" / "payments" / "jobs.py",
    ]


def test_a_virtualenv_made_in_the_project_after_the_first_look_is_left_out(project):
    tree = _Tree({(project, True)})
    seen = tree.snapshot()
    venv = project / "env"
    venv.mkdir()
    (venv / "lib.py").write_text("")
    assert _changed(seen, seen := tree.snapshot()) == [venv / "lib.py"]
    # The directory listed before it held pyvenv.cfg: it is left out once it does.
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    _touch(venv / "lib.py", "x = 1\n")
    assert venv / "lib.py" not in tree.snapshot()


def test_a_root_that_is_not_walked_lists_its_own_files_only(project):
    found = _Tree({(project / "shop", False)}).snapshot()
    assert list(found) == [project / "shop" / "jobs.py"]
