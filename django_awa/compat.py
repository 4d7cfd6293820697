"""Differences between the supported Django versions (5.2 LTS and 6.x)."""

from __future__ import annotations

from django.db import transaction

# Django 6.1 renamed transaction.savepoint() to savepoint_create().
savepoint_create = getattr(transaction, "savepoint_create", None) or transaction.savepoint
