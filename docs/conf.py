"""Sphinx configuration for django-awa's documentation (MyST Markdown + autodoc).

    sphinx-build -W --keep-going -b html docs docs/_build

Its dependencies are the ``docs`` extra. The settings reference is generated
from ``django_awa.conf`` (``_ext/awa_settings.py``) and the API reference from
docstrings, so neither can drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

# autodoc imports the modules, which need Django's app registry (no database).
if not settings.configured:
    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_awa"],
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "docs"}},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
    )
    django.setup()

import django_awa  # noqa: E402 - after django.setup()

project = "django-awa"
author = "The django-awa authors"
copyright = "2026, The django-awa authors"
release = django_awa.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "awa_settings",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4
# The how-to pages include sections of README.md, whose headings start at ###.
suppress_warnings = ["myst.header"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}

html_theme = "alabaster"
html_title = f"django-awa {release}"
