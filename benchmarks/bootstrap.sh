#!/usr/bin/env bash
# Create (or update) benchmarks/.venv: Python 3.12, the peer job queues from
# requirements.txt, and django-awa from the repository root when it can be
# installed. Idempotent; run.py calls it when the environment is missing or
# requirements.txt changed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
venv="$here/.venv"
python="${BENCH_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}"
if [ ! -x "$python" ]; then
    python="$(command -v python3.12 || true)"
fi
if [ -z "$python" ]; then
    echo "bootstrap: Python 3.12 not found (set BENCH_PYTHON)" >&2
    exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "bootstrap: creating $venv with $python" >&2
    "$python" -m venv "$venv"
fi

echo "bootstrap: installing peers from requirements.txt" >&2
if ! "$venv/bin/python" -m pip install --disable-pip-version-check \
    -r "$here/requirements.txt" >"$venv/pip-install.log" 2>&1; then
    tail -n 30 "$venv/pip-install.log" >&2
    echo "bootstrap: pip install failed (full log: $venv/pip-install.log)" >&2
    exit 1
fi

# django-awa itself, editable, once the repository has packaging metadata.
# Until then the django-awa adapter runs it from the repository root on
# PYTHONPATH (Django and psycopg are already installed above).
awa_state="absent"
if [ -f "$root/setup.cfg" ] || [ -f "$root/pyproject.toml" ] || [ -f "$root/setup.py" ]; then
    if "$venv/bin/python" -m pip install --disable-pip-version-check \
        -e "$root" >"$venv/awa-install.log" 2>&1; then
        awa_state="editable"
    else
        awa_state="failed"
        echo "bootstrap: 'pip install -e $root' failed (see .venv/awa-install.log);" \
             "django-awa will run from the repository root on PYTHONPATH" >&2
    fi
else
    echo "bootstrap: $root has no setup.cfg/pyproject.toml yet;" \
         "django-awa will run from the repository root on PYTHONPATH" >&2
fi

# The stamp run.py compares to decide whether to bootstrap again: the
# requirements and the repository's packaging files, as they were installed.
{
    echo "requirements=$(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
    echo "packaging=$(cat "$root/setup.cfg" "$root/pyproject.toml" "$root/setup.py" 2>/dev/null | sha256sum | cut -d' ' -f1)"
    echo "django-awa=$awa_state"
} >"$venv/.bench-stamp"
echo "bootstrap: done (django-awa: $awa_state)" >&2
