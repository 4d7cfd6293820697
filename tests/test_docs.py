"""The documentation site (docs/): it builds without a warning, and its settings
reference, generated from django_awa.conf, names every setting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from django_awa import conf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import awa_settings  # noqa: E402 - the docs' own extension, from docs/_ext
from sphinx.errors import ExtensionError  # noqa: E402


def test_every_setting_has_a_description_and_no_description_is_stray() -> None:
    assert set(conf.DESCRIPTIONS) == set(conf.DEFAULTS)
    assert set(conf.DURATIONS) <= set(conf.DEFAULTS)
    assert all(text.strip() for text in conf.DESCRIPTIONS.values())


def test_the_generated_reference_has_a_row_per_setting_with_its_default() -> None:
    table = awa_settings.settings_table()
    keys = re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE)
    assert keys == list(conf.DEFAULTS)
    assert "| `HEARTBEAT_INTERVAL` | `5` s |" in table
    assert "| `COMPLETED_RETENTION` | `86400` s (1 day) |" in table
    assert "| `CLAIM_BATCH_SIZE` | `500` |" in table


def test_a_setting_without_a_description_stops_the_build(monkeypatch) -> None:
    monkeypatch.setitem(conf.DEFAULTS, "NEW_KNOB", 1)
    with pytest.raises(ExtensionError, match=r"undescribed \['NEW_KNOB'\]"):
        awa_settings.settings_table()


def test_the_readme_settings_table_names_every_setting_too() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Settings", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.MULTILINE)
    assert sorted(listed) == sorted(conf.DEFAULTS)


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         str(ROOT / "docs"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    settings_page = (tmp_path / "settings.html").read_text()
    for key in conf.DEFAULTS:
        assert key in settings_page, key
    api = (tmp_path / "api.html").read_text()
    assert "Insert one job and return its row" in api  # enqueue's docstring
