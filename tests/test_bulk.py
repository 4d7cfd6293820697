"""Bulk operations over a filter (django_awa.bulk), through ``manage.py awa_jobs``:
batches, the workflow rules, follow-ups, output and exit codes."""

from __future__ import annotations

import datetime as dt
import json

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

import django_awa as awa
from django_awa import bulk, producer, sql
from django_awa.execute import completed
from django_awa.finalize import finalize
from django_awa.maintenance import Maintenance
from django_awa.models import Job, JobState
from django_awa.testing import run_jobs
from tests.conftest import make_job, wait_for
from tests.test_archive import in_thread
from tests.test_commands import run, shell
from tests.testapp.jobs import Act, KeyedSpan, Node, Receipt, SequencedSpan

pytestmark = pytest.mark.django_db(transaction=True)


def table_of(job_id: int) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM awa_job WHERE id = %s", [job_id])
        return str(cursor.fetchone()[0])


def lock_waits() -> int:
    """Statements of this database waiting on a lock, asked from outside any transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


def states(jobs: list[Job]) -> list[str]:
    found = dict(Job.objects.filter(id__in=[j.id for j in jobs]).values_list("id", "state"))
    return [found[j.id] for j in jobs]


def test_cancel_over_a_filter_in_batches_cascades_and_inserts_on_cancelled_followups():
    acts = [awa.enqueue(Act(action="ok"), queue="bulkq") for _ in range(5)]
    dependent = awa.enqueue(Node(name="after"), after=[acts[0]])
    other = awa.enqueue(Act(action="ok"), queue="elsewhere")

    out, code = run(
        "awa_jobs", "cancel", "--queue", "bulkq", "--batch-size", "2", "--reason", "drained",
        "--json",
    )  # fmt: skip
    assert code == 0, out
    document = json.loads(out)
    assert document["matched"] == 5 and document["cancelled"] == 5
    assert document["batches"] == 3 and document["failed"] == []
    assert states(acts) == ["cancelled"] * 5 and states([other]) == ["available"]
    # The dependency cascade of awa.cancel: the dependent is cancelled by acts[0].
    row = Job.objects.get(id=dependent.id)
    assert row.state == "cancelled" and row.metadata["awa_cancelled_by"] == acts[0].id
    # on_cancelled follow-ups, one per cancelled job (and the dependent's own).
    notes = sorted(
        Job.objects.filter(kind="echo", metadata__awa_trigger__outcome="cancelled").values_list(
            "metadata__awa_trigger__job_id", flat=True
        )
    )
    assert notes == sorted([a.id for a in acts] + [dependent.id])
    assert Job.objects.get(id=acts[1].id).errors[-1]["error"].endswith("drained")


def test_cancelling_a_workflow_in_batches_never_releases_its_all_done_step():
    flow = awa.Workflow("cancelled in batches")
    root = flow.add(Node(name="root"))
    members = [flow.add(Node(name=f"member{i}"), after=[root]) for i in range(5)]
    report = flow.add(Node(name="report"), after=members, requires="finished")
    flow.enqueue()
    seen = []

    def after_batch(result: bulk.Result) -> None:
        seen.append(Job.objects.get(id=report.job.id).state)

    jobs = Job.objects.filter(workflow_id=root.job.workflow_id)
    up_to = max(jobs.values_list("id", flat=True))
    bulk.run(jobs, bulk.Operation.CANCEL, up_to=up_to, batch_size=2, on_batch=after_batch)
    # Cancelled in its own batch, before its dependencies: never released to run.
    assert seen and set(seen) == {JobState.CANCELLED}
    assert set(jobs.values_list("state", flat=True)) == {JobState.CANCELLED}


def test_retry_over_a_filter_brings_archived_rows_back_and_reopens_their_dependents():
    acts = [awa.enqueue(Act(action="ok"), queue="bulkq") for _ in range(4)]
    dependent = awa.enqueue(Node(name="after"), after=[acts[0]])
    assert run("awa_jobs", "cancel", "--queue", "bulkq")[1] == 0
    Job.objects.filter(id__in=[a.id for a in acts]).update(
        state=JobState.FAILED, finalized_at=timezone.now() - timezone.timedelta(hours=1)
    )
    Maintenance().archive()
    assert {table_of(a.id) for a in acts} == {"awa_job_done"}

    out, code = run(
        "awa_jobs", "retry", "--queue", "bulkq", "--state", "failed", "--batch-size", "3"
    )
    assert code == 0, out
    assert out.splitlines()[0] == "retried 4 of 4 matching job(s)"
    assert "2 batch(es) of up to 3" in out
    assert states(acts) == ["available"] * 4
    assert {table_of(a.id) for a in acts} == {"awa_job"}
    assert all(j.attempt == 0 for j in Job.objects.filter(id__in=[a.id for a in acts]))
    # The dependent its cancellation cancelled waits for it again (awa.retry's rule).
    assert Job.objects.get(id=dependent.id).state == "blocked"
    # Nothing left to retry: exit 1.
    assert run("awa_jobs", "retry", "--queue", "bulkq", "--state", "failed")[1] == 1


def test_move_and_priority_over_a_filter_with_a_dry_run_first():
    waiting = [make_job(queue="from", priority=2) for _ in range(3)]
    running = make_job(queue="from", state=JobState.RUNNING, heartbeat_at=timezone.now())
    done = make_job(queue="from", state=JobState.COMPLETED, finalized_at=timezone.now())

    out, code = run("awa_jobs", "move", "--queue", "from", "--to", "into", "--dry-run")
    assert code == 0 and out.startswith("would move 3 job(s)")
    assert Job.objects.filter(queue="into").count() == 0

    out, code = run("awa_jobs", "move", "--queue", "from", "--to", "into", "--json")
    assert code == 0 and json.loads(out)["moved"] == 3
    assert sorted(Job.objects.filter(queue="into").values_list("id", flat=True)) == sorted(
        j.id for j in waiting
    )
    # A running attempt and a finished job keep their queue.
    assert Job.objects.get(id=running.id).queue == "from" == Job.objects.get(id=done.id).queue

    Job.objects.filter(id=waiting[0].id).update(metadata={"awa_original_priority": 4})
    out, code = run("awa_jobs", "priority", "--set", "1", "--queue", "into")
    assert code == 0 and out.startswith("reprioritized 3 of 3 matching job(s)"), out
    rows = Job.objects.filter(id__in=[j.id for j in waiting])
    assert {j.priority for j in rows} == {1}
    assert all("awa_original_priority" not in j.metadata for j in rows)

    # By id, too; an id that is not waiting is left alone.
    out, code = run("awa_jobs", "priority", "--set", "3", str(waiting[1].id), str(running.id))
    assert code == 0 and out.startswith("reprioritized 1 of 1 matching job(s)")
    assert Job.objects.get(id=running.id).priority != 3


@pytest.mark.parametrize(
    "args",
    [
        ("awa_jobs", "move", "--queue", "a"),  # no --to
        ("awa_jobs", "move", "--queue", "a", "--to", "bad queue"),
        ("awa_jobs", "priority", "--set", "9", "--queue", "a"),
        ("awa_jobs", "priority", "--set", "one", "--queue", "a"),
        ("awa_jobs", "retry", "--queue", "a", "--batch-size", "0"),
        ("awa_jobs", "retry", "12", "--dry-run"),
        ("awa_jobs", "discard", "--queue", "a"),  # needs --yes
        ("awa_jobs", "retry", "--queue", "bad!name"),
        ("awa_jobs", "cancel", "--queue", "bad!name"),
        ("awa_jobs", "list", "--queue", "bad!name"),
    ],
)
def test_bad_bulk_arguments_are_exit_2_and_change_nothing(args: tuple[str, ...]):
    job = make_job(queue="a", state=JobState.FAILED, finalized_at=timezone.now())
    assert run(*args)[1] == 2
    row = Job.objects.get(id=job.id)
    assert (row.queue, row.state, row.priority) == ("a", "failed", job.priority)


def test_a_bad_argument_is_named_in_a_real_process():
    result = shell("awa_jobs", "move", "--queue", "a", "--to", "bad queue")
    assert result.returncode == 2 and "target queue" in result.stderr
    result = shell("awa_jobs", "priority", "--set", "7", "--queue", "a", "--dry-run")
    assert result.returncode == 2 and "priority must be 1 (highest) to 4" in result.stderr


def test_a_move_refuses_jobs_of_a_limited_kind_off_its_queue_and_allows_them_onto_it():
    # KeyedSpan's awa.Limit holds on its queue, bykey: a worker of another queue would
    # run its jobs beside the limit, a key's two jobs at once (enqueue refuses that).
    keyed = awa.enqueue_many([KeyedSpan(key="a"), KeyedSpan(key="a")])
    other = awa.enqueue(Act(), queue="bykey")
    everything = Job.objects.filter(queue="bykey")
    found = bulk.preview(everything, bulk.Operation.MOVE)
    with pytest.raises(
        awa.ValidationError,
        match=r"move: kind\(s\) 'keyed_span' \(2 job\(s\); its queue 'bykey'\) have an "
        r"awa\.Limit, .* moved to 'elsewhere' they would run beside their limit\. Nothing changed",
    ):
        bulk.run(everything, bulk.Operation.MOVE, up_to=found.up_to, queue="elsewhere")
    assert set(Job.objects.values_list("queue", flat=True)) == {"bykey"}
    assert producer.claim("elsewhere", 10, "default") == []
    result = shell("awa_jobs", "move", "--queue", "bykey", "--to", "elsewhere")
    assert result.returncode == 1 and "would run beside their limit" in result.stderr
    assert set(Job.objects.values_list("queue", flat=True)) == {"bykey"}

    # Others move; and jobs of the kind left on another queue move onto its own.
    acts = Job.objects.filter(id=other.id)
    assert bulk.run(acts, bulk.Operation.MOVE, up_to=other.id, queue="elsewhere").changed == 1
    Job.objects.filter(id=keyed[0]).update(queue="stray")
    strays = Job.objects.filter(queue="stray")
    assert bulk.run(strays, bulk.Operation.MOVE, up_to=keyed[0], queue="bykey").changed == 1
    assert Job.objects.get(id=keyed[0]).queue == "bykey"


def test_only_jobs_up_to_the_previewed_id_are_touched():
    before = [make_job(queue="q", state=JobState.FAILED, finalized_at=timezone.now())]
    found = bulk.preview(Job.objects.filter(queue="q"), bulk.Operation.RETRY)
    later = make_job(queue="q", state=JobState.FAILED, finalized_at=timezone.now())
    result = bulk.run(Job.objects.filter(queue="q"), bulk.Operation.RETRY, up_to=found.up_to)
    assert (found.count, result.changed) == (1, 1)
    assert states(before) == ["available"] and states([later]) == ["failed"]


def test_a_retry_batch_one_job_spoils_is_redone_one_by_one():
    # Two failed jobs with one unique key: only one may be live again.
    unique = awa.Unique(by_args=True, states=("available", "scheduled", "running", "retryable"))
    first = awa.enqueue(Act(action="same"), queue="uq", unique=unique)
    Job.objects.filter(id=first.id).update(state=JobState.FAILED, finalized_at=timezone.now())
    second = awa.enqueue(Act(action="same"), queue="uq", unique=unique)
    Job.objects.filter(id=second.id).update(state=JobState.FAILED, finalized_at=timezone.now())

    out, code = run("awa_jobs", "retry", "--queue", "uq", "--json")
    document = json.loads(out)
    assert code == 1  # one refused
    assert document["retried"] == 1 and [f["id"] for f in document["failed"]] == [second.id]
    assert "unique key" in document["failed"][0]["error"]
    assert states([first, second]) == ["available", "failed"]


def test_discard_over_a_filter_settles_the_dependents_of_discarded_jobs_in_its_batch():
    # The deletion rule of workflows holds for a bulk discard as for an ORM delete:
    # a discarded unfinished dependency cancels its requires="completed"
    # dependents and counts as finished for requires="finished" ones, at once.
    doomed = awa.enqueue(Act(action="ok"), queue="bulkq")
    child = awa.enqueue(Node(name="child"), after=[doomed])
    report = awa.enqueue(Node(name="report"), after=[doomed], requires="finished")

    out, code = run("awa_jobs", "discard", "--queue", "bulkq", "--yes", "--json")
    assert code == 0, out
    assert json.loads(out)["discarded"] == 1
    assert not Job.objects.filter(id=doomed.id).exists()
    row = Job.objects.get(id=child.id)
    assert row.state == JobState.CANCELLED
    assert row.errors[-1]["error"] == f"cancelled: dependency {doomed.id} deleted"
    assert states([report]) == [JobState.AVAILABLE]


# -- rekind --------------------------------------------------------------------------


def kinds(jobs: list[Job]) -> list[str]:
    found = dict(Job.objects.filter(id__in=[j.id for j in jobs]).values_list("id", "kind"))
    return [found[j.id] for j in jobs]


def test_rekind_gives_the_waiting_jobs_of_a_renamed_kind_the_new_kind():
    later = timezone.now() + dt.timedelta(hours=1)
    waiting = [
        make_job(kind="charge_card", queue="rk"),
        make_job(kind="charge_card", queue="rk", state=JobState.SCHEDULED, run_at=later),
        make_job(kind="charge_card", queue="rk", state=JobState.RETRYABLE, run_at=later),
        make_job(kind="charge_card", queue="rk", state=JobState.BLOCKED),
    ]
    under_way = [
        make_job(kind="charge_card", queue="rk", state=JobState.RUNNING,
                 heartbeat_at=timezone.now()),
        make_job(kind="charge_card", queue="rk", state=JobState.WAITING_EXTERNAL),
    ]  # fmt: skip
    finished = [
        make_job(kind="charge_card", queue="rk", state=state, finalized_at=timezone.now())
        for state in JobState.FINAL
    ]
    elsewhere = make_job(kind="charge_card", queue="other")

    out, code = run("awa_jobs", "rekind", "charge_card", "act", "--queue", "rk", "--dry-run")
    assert code == 0, out
    assert out.startswith("would rekind 4 job(s) of kind 'charge_card' to 'act'"), out
    assert "left 2 job(s) of kind 'charge_card' running or waiting for a callback" in out
    assert set(kinds([*waiting, elsewhere])) == {"charge_card"}

    out, code = run("awa_jobs", "rekind", "charge_card", "act", "--queue", "rk", "--json")
    assert code == 0, out
    assert json.loads(out) == {
        "old_kind": "charge_card", "new_kind": "act", "dry_run": False,
        "rekinded": 4, "in_progress": 2, "new_kind_declared": True,
        "unfit": 0, "unfit_jobs": [], "unique_keys_remade": 0, "unique_keys_kept": 0,
        "sequence_keys_remade": 0, "sequence_keys_kept": 0, "off_queue": {},
        "sequences_split": 0,
    }  # fmt: skip
    assert kinds(waiting) == ["act"] * 4
    assert set(kinds([*under_way, *finished, elsewhere])) == {"charge_card"}
    # The available one now runs under the new kind's handler.
    assert run_jobs(queue="rk").completed == 1
    assert Job.objects.get(id=waiting[0].id).state == JobState.COMPLETED

    out, code = run("awa_jobs", "rekind", "charge_card", "act", "--queue", "rk")
    assert code == 1 and out.startswith("rekinded 0 job(s)"), out


def test_rekind_to_a_kind_no_worker_declares_is_refused_unless_forced():
    job = make_job(kind="charge_card", unique_key="k" * 64, unique_states=["available"])
    result = shell("awa_jobs", "rekind", "charge_card", "ech")
    assert result.returncode == 2, result.stderr
    assert (
        "no @awa.worker of this project declares kind 'ech' (did you mean 'echo'?)" in result.stderr
    )
    assert "--force" in result.stderr
    assert kinds([job]) == ["charge_card"]

    out, code = run("awa_jobs", "rekind", "charge_card", "ech", "--force")
    assert code == 0 and out.startswith("rekinded 1 job(s)"), out
    assert (
        "unique keys were left as they were (made from kind 'charge_card'): kind 'ech' is not "
        "declared here, so its awa.Unique is not known" in out
    ), out
    assert kinds([job]) == ["ech"]
    assert Job.objects.get(id=job.id).unique_key == "k" * 64


def receipt_job(args: dict[str, object], **fields: object) -> Job:
    """A job of kind print_receipt: Receipt's kind before the class was renamed."""
    return make_job(kind="print_receipt", queue="receipts", args=args, **fields)


def test_rekinded_jobs_get_the_unique_key_of_the_new_kind_in_a_real_process():
    held = list(JobState.UNIQUE_HELD)
    keyed = receipt_job({"order_id": 1}, unique_key="a" * 64, unique_states=held)
    unkeyed = receipt_job({"order_id": 2, "copies": 1})
    result = shell("awa_jobs", "rekind", "print_receipt", "receipt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rekinded 2 job(s) of kind 'print_receipt' to 'receipt'")
    assert "2 of them got the unique key of kind 'receipt' (its awa.Unique)" in result.stdout

    # A job of the new kind with the same args is now refused as their duplicate,
    # a default (copies=1) filled in or given alike.
    for order_id, holder in ((1, keyed), (2, unkeyed)):
        with pytest.raises(awa.UniqueConflict) as refused:
            awa.enqueue(Receipt(order_id=order_id))
        assert refused.value.conflicting_id == holder.id
    assert awa.enqueue(Receipt(order_id=3)).kind == "receipt"
    row = Job.objects.get(id=keyed.id)
    assert (row.kind, row.unique_states) == ("receipt", held)


def test_rekind_refuses_jobs_that_would_share_a_unique_key_and_changes_nothing():
    # Two keys of the old kind, one of the new: {"order_id": 5} is Receipt(order_id=5).
    first = receipt_job({"order_id": 5}, unique_key="b" * 64, unique_states=["available"])
    second = receipt_job({"order_id": 5, "copies": 1})
    other = receipt_job({"order_id": 6})
    out, code = run("awa_jobs", "rekind", "print_receipt", "receipt")
    assert code == 1, out
    # One batch per job: the clash is found across batches too, and the first
    # batch's change is rolled back with the rest.
    with pytest.raises(awa.UniqueConflict) as refused:
        bulk.rekind("print_receipt", "receipt", batch_size=1, using="default")
    message = str(refused.value)
    assert f"jobs {first.id} and {second.id} would both hold the unique key " in message
    assert "of kind 'receipt' (its awa.Unique): nothing changed" in message
    assert kinds([first, second, other]) == ["print_receipt"] * 3
    assert Job.objects.get(id=first.id).unique_key == "b" * 64

    # A job of the new kind holding the key already.
    Job.objects.filter(id=second.id).delete()
    holder = awa.enqueue(Receipt(order_id=5))
    with pytest.raises(awa.UniqueConflict) as refused:
        bulk.rekind("print_receipt", "receipt", using="default")
    assert (
        f"jobs {holder.id} and {first.id} would both hold the unique key {holder.unique_key} "
        in str(refused.value)
    )
    assert refused.value.conflicting_id == holder.id
    assert kinds([first, other]) == ["print_receipt"] * 2

    # Once the holder is done (a completed job holds Receipt's key too: discarded).
    Job.objects.filter(id=holder.id).delete()
    out, code = run("awa_jobs", "rekind", "print_receipt", "receipt", "--json")
    assert code == 0, out
    assert json.loads(out)["unique_keys_remade"] == 2
    assert kinds([first, other]) == ["receipt"] * 2


def test_rekind_refuses_args_the_new_kind_cannot_decode_unless_forced():
    fits = receipt_job({"order_id": 1})
    renamed_field = receipt_job({"order": 2})
    wrong_type = receipt_job({"order_id": "3"}, unique_key="c" * 64, unique_states=["available"])
    jobs = [fits, renamed_field, wrong_type]

    out, code = run("awa_jobs", "rekind", "print_receipt", "receipt", "--dry-run")
    assert code == 1, out
    with pytest.raises(awa.ValidationError) as refused:
        bulk.rekind("print_receipt", "receipt", batch_size=2, using="default")
    assert str(refused.value) == (
        "rekind: the args of 2 job(s) of kind 'print_receipt' do not fit Receipt (kind "
        f"'receipt'), so a worker would fail them: job {renamed_field.id}: cannot decode args "
        f"of kind 'receipt': field 'order_id' is missing; job {wrong_type.id}: cannot decode "
        "args of kind 'receipt': field 'order_id': expected an integer, got '3'. Nothing "
        "changed; with --force they are rekinded all the same"
    )
    assert kinds(jobs) == ["print_receipt"] * 3

    out, code = run("awa_jobs", "rekind", "print_receipt", "receipt", "--force", "--dry-run")
    assert code == 0, out
    assert out.startswith("would rekind 3 job(s)"), out
    assert "2 of them have args kind 'receipt' cannot decode: a worker fails them." in out
    assert "1 of them would keep the unique key made from kind 'print_receipt': their args " in out
    assert kinds(jobs) == ["print_receipt"] * 3

    out, code = run("awa_jobs", "rekind", "print_receipt", "receipt", "--force", "--json")
    assert code == 0, out
    document = json.loads(out)
    assert (document["rekinded"], document["unfit"], document["unique_keys_kept"]) == (3, 2, 1)
    assert [job["id"] for job in document["unfit_jobs"]] == [renamed_field.id, wrong_type.id]
    assert kinds(jobs) == ["receipt"] * 3
    run_jobs(queue="receipts")
    assert states(jobs) == [JobState.COMPLETED, JobState.FAILED, JobState.FAILED]
    assert "field 'order_id' is missing" in Job.objects.get(id=renamed_field.id).errors[-1]["error"]


def test_a_job_claimed_while_rekind_waits_for_it_keeps_its_old_kind():
    claimed, waiting = receipt_job({"order_id": 1}), receipt_job({"order_id": 2})
    # A worker's claim of the first job, begun in a session of its own and held
    # uncommitted: the rekind waits on its row lock.
    claim = psycopg.connect(**connection.get_connection_params())
    try:
        params = {"queue": "receipts", "limit": 1, "deadlines": "{}", "default_deadline": 60}
        assert [row[0] for row in claim.execute(sql.CLAIM, params).fetchall()] == [claimed.id]
        done = in_thread(lambda: bulk.rekind("print_receipt", "receipt", using="default"))
        wait_for(lock_waits, message="the rekind waiting on the claim's row lock")
        claim.commit()
    finally:
        claim.close()
    rekinded = done()
    assert (rekinded.changed, rekinded.in_progress) == (1, 1)
    row = Job.objects.get(id=claimed.id)
    assert (row.kind, row.state, row.unique_key) == ("print_receipt", JobState.RUNNING, None)
    assert kinds([waiting]) == ["receipt"]


# Kind old_span: SequencedSpan's kind before the class was renamed, with its sequence="key".
OLD_KEY_A = 'old_span:["a"]'


def span_job(key: str, n: int, sequence: str | None = None, **fields: object) -> Job:
    metadata = {"awa_sequence": sequence} if sequence else {}
    fields.setdefault("metadata", metadata)
    return make_job(kind="old_span", queue="seq", args={"key": key, "n": n}, **fields)


def sequence_key(job: Job) -> str | None:
    return Job.objects.get(id=job.id).metadata.get("awa_sequence")


def test_rekinded_jobs_get_the_sequence_key_of_the_new_kind_and_wait_their_turn_in_it():
    first = span_job("a", 1, OLD_KEY_A)
    # Parked by a claim behind the first: its run_at kept in metadata.
    enqueued_at = timezone.now() - dt.timedelta(minutes=1)
    parked = span_job(
        "a",
        2,
        run_at=dt.datetime(9999, 12, 31, tzinfo=dt.UTC),
        metadata={"awa_sequence": OLD_KEY_A, "awa_sequence_run_at": enqueued_at.isoformat()},
    )
    given = span_job("b", 3, "ledger-7")  # EnqueueRequest(sequence="ledger-7")
    unkeyed = span_job("c", 4)
    newer = awa.enqueue(SequencedSpan(key="a", n=5))

    out, code = run("awa_jobs", "rekind", "old_span", "sequenced_span")
    assert code == 0, out
    assert "3 of them got the sequence key of kind 'sequenced_span' (its sequence=)" in out, out
    assert [sequence_key(j) for j in (first, parked, given, unkeyed)] == [
        newer.metadata["awa_sequence"],
        newer.metadata["awa_sequence"],
        "ledger-7",
        awa.enqueue(SequencedSpan(key="c")).metadata["awa_sequence"],
    ]
    row = Job.objects.get(id=parked.id)
    assert (row.run_at, "awa_sequence_run_at" in row.metadata) == (enqueued_at, False)

    # One member of each key at a time, the rekinded ones (enqueued first) before
    # the job of the new kind.
    claimed = producer.claim_sequenced("seq", 10, "default")
    assert sorted(j.id for j in claimed) == [first.id, given.id, unkeyed.id]
    assert finalize([completed(next(j for j in claimed if j.id == first.id))], "default")
    (second,) = producer.claim_sequenced("seq", 10, "default")
    assert second.id == parked.id
    assert finalize([completed(second)], "default")
    assert [j.id for j in producer.claim_sequenced("seq", 10, "default")] == [newer.id]


def test_rekind_keeps_the_old_sequence_key_where_the_new_kind_declares_no_sequence():
    running = span_job("a", 1, OLD_KEY_A, state=JobState.RUNNING, heartbeat_at=timezone.now())
    waiting = span_job("a", 2, OLD_KEY_A)
    out, code = run("awa_jobs", "rekind", "old_span", "span")
    assert code == 0, out
    assert (
        "1 of them kept the sequence key made from kind 'old_span': kind 'span' declares no "
        "sequence=, so they stay in line behind that key's unfinished jobs of kind 'old_span'"
    ) in out, out
    assert (kinds([waiting]), sequence_key(waiting)) == (["span"], OLD_KEY_A)
    # It still waits for the old kind's running member of its key.
    assert producer.claim_sequenced("seq", 10, "default") == []
    assert finalize([completed(Job.objects.get(id=running.id))], "default")
    assert [j.id for j in producer.claim_sequenced("seq", 10, "default")] == [waiting.id]


def test_rekind_refuses_to_let_jobs_start_beside_their_sequence_unless_forced():
    # Left behind: the old kind's running member of the key the waiting job leaves.
    running_old = span_job("a", 1, OLD_KEY_A, state=JobState.RUNNING, heartbeat_at=timezone.now())
    waiting_a = span_job("a", 2, OLD_KEY_A)
    # Joined: a running job of the new kind holds the key the waiting job takes.
    running_new = awa.enqueue(SequencedSpan(key="b"))
    Job.objects.filter(id=running_new.id).update(state=JobState.RUNNING)
    waiting_b = span_job("b", 3, 'old_span:["b"]')
    jobs = [waiting_a, waiting_b]

    out, code = run("awa_jobs", "rekind", "old_span", "sequenced_span")
    assert code == 1, out
    with pytest.raises(awa.ValidationError) as refused:
        bulk.rekind("old_span", "sequenced_span", batch_size=1, using="default")
    assert str(refused.value).startswith(
        "rekind: the rekinded jobs would take the sequence key of kind 'sequenced_span' (its "
        "sequence=), and could then start before 2 job(s) of their old or new key finish, out "
        f"of their one-at-a-time order: job {running_old.id} (running, sequence key "
        f"'old_span:[\"a\"]'); job {running_new.id} (running, sequence key "
        "'sequenced_span:[\"b\"]'). Nothing changed; rekind again once those are finished"
    ), refused.value
    assert kinds(jobs) == ["old_span"] * 2
    assert [sequence_key(j) for j in jobs] == [OLD_KEY_A, 'old_span:["b"]']

    out, code = run("awa_jobs", "rekind", "old_span", "sequenced_span", "--force", "--json")
    assert code == 0, out
    document = json.loads(out)
    assert (document["rekinded"], document["sequences_split"]) == (2, 2)
    assert kinds(jobs) == ["sequenced_span"] * 2


def test_rekind_refuses_jobs_off_the_queue_of_the_new_kinds_limit_unless_forced():
    # KeyedSpan's awa.Limit holds on its queue, bykey: enqueue refuses it elsewhere.
    with pytest.raises(awa.ValidationError, match="cannot be enqueued on 'flow'"):
        awa.enqueue(KeyedSpan(key="k"), queue="flow")
    on_queue = make_job(kind="old_keyed", queue="bykey", args={"key": "k"})
    off_queue = [
        make_job(kind="old_keyed", queue=queue, args={"key": "k"})
        for queue in ("flow", "flow", "other")
    ]
    jobs = [on_queue, *off_queue]

    result = shell("awa_jobs", "rekind", "old_keyed", "keyed_span")
    assert result.returncode == 1, result.stderr
    assert (
        "rekind: kind 'keyed_span' has an awa.Limit, which holds on its queue 'bykey', so "
        "enqueue refuses its jobs on any other; 3 job(s) of kind 'old_keyed' wait on queue(s) "
        "'flow' (2 job(s)), 'other' (1 job(s)). Nothing changed; move them to 'bykey' first"
    ) in result.stderr, result.stderr
    assert kinds(jobs) == ["old_keyed"] * 4

    out, code = run("awa_jobs", "rekind", "old_keyed", "keyed_span", "--queue", "bykey")
    assert code == 0 and out.startswith("rekinded 1 job(s)"), out

    out, code = run("awa_jobs", "rekind", "old_keyed", "keyed_span", "--force", "--dry-run")
    assert code == 0, out
    assert (
        "3 of them wait on queue(s) 'flow' (2 job(s)), 'other' (1 job(s)), not on 'bykey', "
        "where the awa.Limit of kind 'keyed_span' holds: they run there outside the limit"
    ) in out, out
    out, code = run("awa_jobs", "rekind", "old_keyed", "keyed_span", "--force", "--json")
    assert json.loads(out)["off_queue"] == {"flow": 2, "other": 1}
    assert kinds(jobs) == ["keyed_span"] * 4


@pytest.mark.parametrize(
    "args",
    [
        ("awa_jobs", "rekind", "act", "act"),
        ("awa_jobs", "rekind", "act", "echo", "--queue", "bad!name"),
        ("awa_jobs", "rekind", "act", "x" * 256, "--force"),
        # Kinds PostgreSQL cannot hold: a Latin-1 terminal's bytes, a NUL.
        ("awa_jobs", "rekind", "caf\udce9", "act"),
        ("awa_jobs", "rekind", "act", "a\x00b", "--force"),
        ("awa_jobs", "rekind", "act"),
    ],
)
def test_bad_rekind_arguments_are_exit_2_and_change_nothing(args: tuple[str, ...]):
    job = make_job(kind="act")
    assert run(*args)[1] == 2
    assert kinds([job]) == ["act"]
