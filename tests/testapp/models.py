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


class FlowRun(models.Model):
    """One handler run of a flow-control test kind: when it started and ended.

    The flow-control tests assert in SQL over these rows that a limit held at
    every instant, and that runs overlapped where the limits allow it.
    """

    job_id = models.BigIntegerField()
    kind = models.CharField(max_length=100)
    queue = models.CharField(max_length=100)
    key = models.CharField(max_length=100, blank=True, default="")
    n = models.IntegerField(default=0)  # the job's place in its test's enqueue order
    attempt = models.IntegerField()
    attempted_at = models.DateTimeField()  # the attempt's claim (its row's heartbeat_at then)
    started_at = models.DateTimeField()  # the handler's start and end (this machine's clock)
    ended_at = models.DateTimeField(null=True)
    pid = models.IntegerField()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"run of job {self.job_id} ({self.key}) {self.started_at}-{self.ended_at}"
