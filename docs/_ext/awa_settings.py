"""The settings reference, generated from ``django_awa.conf`` at build time.

``settings.md`` holds the prose; this appends one table row per key of
``conf.DEFAULTS``, with its default (seconds for ``conf.DURATIONS``) and its
text from ``conf.DESCRIPTIONS``. A key without a description, or a description
without a key, stops the build: the reference cannot leave a setting out.
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

MARKER = "<!-- awa-settings-table -->"


def _default(key: str, value: Any, durations: dict[str, bool]) -> str:
    if key in durations and value is not None:
        seconds = float(value)
        text = f"`{seconds:g}` s"
        for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
            if seconds >= size and seconds % size == 0:
                count = int(seconds // size)
                text += f" ({count} {unit if count != 1 else unit[:-1]})"
                break
        return text
    return f"`{value!r}`"


def settings_table() -> str:
    from django_awa import conf

    missing = sorted(set(conf.DEFAULTS) - set(conf.DESCRIPTIONS))
    extra = sorted(set(conf.DESCRIPTIONS) - set(conf.DEFAULTS))
    if missing or extra:
        raise ExtensionError(
            f"django_awa.conf.DESCRIPTIONS does not match DEFAULTS: "
            f"undescribed {missing}, described but unknown {extra}"
        )
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, value in conf.DEFAULTS.items():
        text = conf.DESCRIPTIONS[key].replace("|", "\\|").replace("\n", " ")
        optional = " `None` is allowed." if conf.DURATIONS.get(key) else ""
        if optional and "None" in text:
            optional = ""
        default = _default(key, value, conf.DURATIONS).replace("|", "\\|")
        rows.append(f"| `{key}` | {default} | {text}{optional} |")
    return "\n".join(rows) + "\n"


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    if MARKER in source[0]:
        source[0] = source[0].replace(MARKER, settings_table())


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
