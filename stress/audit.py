"""Loss and duplication audits, counted in SQL, shared by tests/test_faults.py and crash_soak.py.

Each function takes a DB-API cursor on the job database and the ids of the
jobs a run enqueued (its triggers), and returns rows that break a guarantee:
an empty list means the guarantee held.

The follow-ups expected of a trigger are derived from what its row committed,
for the test kinds of ``tests/testapp`` (``Act``: two Completed follow-ups,
one per Retried, Exhausted, Cancelled and Rescued; ``Parked``: one per
Completed, Exhausted, Retried, Rescued and per committed park; ``Poison``:
one per Completed, Retried, Exhausted, Cancelled and Rescued):

* every ``errors`` entry of a rescue is one committed Rescued outcome;
* every other entry is a handler failure: a Retried outcome, except the
  last one of a ``failed`` job (Exhausted, unless a rescue failed it) and
  of a ``cancelled`` one (the cancel reason);
* a ``completed`` job committed one Completed outcome, a ``cancelled`` one Cancelled;
* a ``Poison`` job waiting out its ``RetryAfter`` committed one Retried outcome
  that left no ``errors`` entry.

A Parked job parks once per committed park; its waiting follow-ups carry the
callback id (``note = "waiting:<uuid>"``), so no callback id may have two.
"""

from __future__ import annotations

from typing import Any

FINAL_STATES = ("completed", "failed", "cancelled")

_OUTCOME_MISMATCHES = """
WITH entries AS (
    SELECT id, kind, state, args ->> 'action' AS action,
           count(e) FILTER (WHERE e ->> 'error' LIKE 'rescued:%%') AS rescued,
           count(e) FILTER (WHERE e ->> 'error' NOT LIKE 'rescued:%%') AS raised,
           (array_agg(e ->> 'error' ORDER BY n DESC))[1] AS last_error
    FROM awa_job
    LEFT JOIN LATERAL jsonb_array_elements(errors) WITH ORDINALITY AS x(e, n) ON true
    WHERE id = ANY(%(ids)s) AND kind IN ('act', 'parked', 'poison')
    GROUP BY id, kind, state, action
),
expected AS (
    SELECT id, kind, rescued,
           raised - CASE WHEN state IN ('failed', 'cancelled')
                              AND last_error NOT LIKE 'rescued:%%'
                         THEN 1 ELSE 0 END
           + CASE WHEN kind = 'poison' AND action = 'huge_retry' AND state = 'retryable'
                  THEN 1 ELSE 0 END AS retried,
           CASE WHEN state = 'failed' AND last_error NOT LIKE 'rescued:%%'
                THEN 1 ELSE 0 END AS exhausted,
           CASE WHEN state = 'completed' THEN (CASE kind WHEN 'act' THEN 2 ELSE 1 END)
                ELSE 0 END AS completed,
           CASE WHEN state = 'cancelled' AND kind IN ('act', 'poison') THEN 1 ELSE 0 END
               AS cancelled
    FROM entries
),
actual AS (
    SELECT (metadata #>> '{awa_trigger,job_id}')::bigint AS id,
           count(*) FILTER (WHERE metadata #>> '{awa_trigger,outcome}' = 'rescued') AS rescued,
           count(*) FILTER (WHERE metadata #>> '{awa_trigger,outcome}' = 'retried') AS retried,
           count(*) FILTER (WHERE metadata #>> '{awa_trigger,outcome}' = 'exhausted')
               AS exhausted,
           count(*) FILTER (WHERE metadata #>> '{awa_trigger,outcome}' = 'completed')
               AS completed,
           count(*) FILTER (WHERE metadata #>> '{awa_trigger,outcome}' = 'cancelled')
               AS cancelled
    FROM awa_job
    WHERE metadata ? 'awa_trigger'
      AND (metadata #>> '{awa_trigger,job_id}')::bigint = ANY(%(ids)s)
    GROUP BY 1
)
SELECT e.id, e.kind,
       e.rescued, e.retried, e.exhausted, e.completed, e.cancelled,
       coalesce(a.rescued, 0), coalesce(a.retried, 0), coalesce(a.exhausted, 0),
       coalesce(a.completed, 0), coalesce(a.cancelled, 0)
FROM expected e LEFT JOIN actual a USING (id)
WHERE (e.rescued, e.retried, e.exhausted, e.completed, e.cancelled)
      IS DISTINCT FROM (coalesce(a.rescued, 0), coalesce(a.retried, 0),
                        coalesce(a.exhausted, 0), coalesce(a.completed, 0),
                        coalesce(a.cancelled, 0))
ORDER BY e.id
"""

_DOUBLE_PARKS = """
SELECT args ->> 'note' AS note, count(*)
FROM awa_job
WHERE kind = 'echo' AND metadata #>> '{awa_trigger,outcome}' = 'waiting_for_callback'
  AND (metadata #>> '{awa_trigger,job_id}')::bigint = ANY(%(ids)s)
GROUP BY 1 HAVING count(*) > 1
"""

# A completed Parked job was completed through the callback it parked on:
# that park committed, so it has its waiting follow-up.
_COMPLETED_WITHOUT_PARK = """
SELECT j.id FROM awa_job AS j
WHERE j.id = ANY(%(ids)s) AND j.kind = 'parked' AND j.state = 'completed'
  AND NOT EXISTS (
      SELECT 1 FROM awa_job AS f
      WHERE f.kind = 'echo'
        AND f.metadata #>> '{awa_trigger,job_id}' = j.id::text
        AND f.args ->> 'note' = 'waiting:' || j.callback_id::text)
"""

# A handler run writes one ledger row as it begins (its action as the note). The
# "sleep" action writes a second, noted "saw-cancel", when it sees its attempt
# cancelled: the same run, seen twice, e.g. when a worker whose link was cut
# hears after the link returns that its attempt was rescued meanwhile. Such
# rows are not runs. Each duplicate names its runs' notes and leases, so a
# real second run of one attempt (two leases, or one lease run twice) reads
# from the report.
_LEDGER_DUPLICATES = """
SELECT job_id, attempt, count(*),
       array_agg(note || '@' || run_lease ORDER BY id) AS runs
FROM testapp_ledger
WHERE job_id = ANY(%(ids)s) AND note <> 'saw-cancel'
GROUP BY 1, 2 HAVING count(*) > 1
ORDER BY 1, 2
"""

# Not final, and not a poison job waiting out its capped day-long delay.
_NOT_FINAL = """
SELECT id, kind, state FROM awa_job
WHERE id = ANY(%(ids)s) AND state NOT IN ('completed', 'failed', 'cancelled')
  AND NOT (kind = 'poison' AND state IN ('retryable', 'scheduled')
           AND run_at > now() + interval '23 hours')
ORDER BY id
"""

# Poison jobs must end with what they raised or returned kept, readable: a
# handler's own error (escaped), not one about storing it.
_UNREADABLE_POISON = """
SELECT id, args ->> 'action', state, errors -> -1 ->> 'error' FROM awa_job
WHERE id = ANY(%(ids)s) AND kind = 'poison'
  AND (state NOT IN ('completed', 'failed', 'cancelled', 'retryable', 'scheduled')
       OR errors::text LIKE '%%could not be stored%%'
       OR ((args ->> 'action' IN ('nul_error', 'surrogate_error', 'nul_cancel')
            OR args ->> 'action' LIKE 'base:%%')
           AND NOT errors @> '[{}]'))
ORDER BY id
"""


def _rows(cursor: Any, statement: str, ids: list[int]) -> list[tuple[Any, ...]]:
    cursor.execute(statement, {"ids": list(ids)})
    return list(cursor.fetchall())


def outcome_mismatches(cursor: Any, ids: list[int]) -> list[tuple[Any, ...]]:
    """Triggers whose follow-ups differ from their committed outcomes:
    (id, kind, expected rescued/retried/exhausted/completed/cancelled, actual ...)."""
    return (
        _rows(cursor, _OUTCOME_MISMATCHES, ids)
        + [("double park", *r) for r in _rows(cursor, _DOUBLE_PARKS, ids)]
        + [("completed without park", *r) for r in _rows(cursor, _COMPLETED_WITHOUT_PARK, ids)]
    )


def ledger_duplicates(cursor: Any, ids: list[int]) -> list[tuple[Any, ...]]:
    """(job_id, attempt, runs, ["note@run_lease", ...]) for each attempt whose handler
    ran more than once."""
    return _rows(cursor, _LEDGER_DUPLICATES, ids)


# An atomic=True ``Pay`` job's handler writes an ``Order`` (by its reference) and a
# ``Ledger`` row, committed with its outcome or not at all: a completed job has
# exactly one of each, any other none, however many attempts were cut short.
_ATOMIC_EFFECTS = """
SELECT id, state, orders, runs FROM (
    SELECT j.id, j.state,
           (SELECT count(*) FROM testapp_order AS o WHERE o.reference = j.args ->> 'reference')
               AS orders,
           (SELECT count(*) FROM testapp_ledger AS l WHERE l.job_id = j.id) AS runs,
           (j.state = 'completed')::int AS once
    FROM awa_job AS j
    WHERE j.id = ANY(%(ids)s) AND j.kind = 'pay'
) AS e
WHERE (orders, runs) IS DISTINCT FROM (once, once)
ORDER BY id
"""


def atomic_effects(cursor: Any, ids: list[int]) -> list[tuple[Any, ...]]:
    """(id, state, orders, runs) of each atomic ``Pay`` job whose committed writes are
    not exactly one for a completed job and none for any other."""
    return _rows(cursor, _ATOMIC_EFFECTS, ids)


def not_final(cursor: Any, ids: list[int]) -> list[tuple[Any, ...]]:
    return _rows(cursor, _NOT_FINAL, ids)


def unreadable_poison(cursor: Any, ids: list[int]) -> list[tuple[Any, ...]]:
    """Poison jobs left in a state they should not be, or whose outcome was not kept."""
    return _rows(cursor, _UNREADABLE_POISON, ids)


def followup_ids(cursor: Any, ids: list[int]) -> list[int]:
    """Ids of the follow-up jobs of ``ids`` (which must run to a final state too)."""
    cursor.execute(
        "SELECT id FROM awa_job WHERE metadata ? 'awa_trigger' "
        "AND (metadata #>> '{awa_trigger,job_id}')::bigint = ANY(%(ids)s)",
        {"ids": list(ids)},
    )
    return [row[0] for row in cursor.fetchall()]


def by_state(cursor: Any, ids: list[int]) -> dict[str, int]:
    cursor.execute(
        "SELECT state, count(*) FROM awa_job WHERE id = ANY(%(ids)s) GROUP BY 1 ORDER BY 1",
        {"ids": list(ids)},
    )
    return dict(cursor.fetchall())
