"""One row per account; every ORM-handler job reads one and updates it."""

from __future__ import annotations

from django.db import models


class HandlerAccount(models.Model):
    balance = models.BigIntegerField(default=0)
    # how many jobs updated this row
    touched = models.IntegerField(default=0)

    class Meta:
        app_label = "bench_handler_app"
        db_table = "bench_handler_account"

    def __str__(self) -> str:
        return f"account {self.pk}: {self.balance}"
