"""An application table the handlers read and update (created by connections.py, no migration)."""

from __future__ import annotations

from django.db import models


class Account(models.Model):
    balance = models.BigIntegerField(default=0)
    touched = models.IntegerField(default=0)

    class Meta:
        app_label = "conn_app"
        db_table = "bench_account"
        managed = False  # connections.py creates it: the benchmark needs no migration

    def __str__(self) -> str:
        return f"account {self.pk}"
