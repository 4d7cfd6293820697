from django.db import models


class Ledger(models.Model):
    """One row per handler run: the tests count side effects with it."""

    job_id = models.BigIntegerField()
    attempt = models.IntegerField()
    run_lease = models.BigIntegerField()
    note = models.CharField(max_length=100, blank=True, default="")

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"run of job {self.job_id} attempt {self.attempt}"


class Order(models.Model):
    """A business row written by atomic handlers."""

    reference = models.CharField(max_length=100)
    paid = models.BooleanField(default=False)

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.reference
