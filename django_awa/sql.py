"""Every hand-written statement and channel name, named.

Each statement opens with its purpose, the locks it takes and the index it
uses. Parameters are always bound (``%(name)s``); no SQL is assembled from
user input. ``JOB_COLUMNS`` is the ``Job`` model's column list, so rows
returned here can be turned into ``Job`` instances (``models.jobs_from_rows``).

Finished jobs move from ``awa_job`` into its inheritance child
``awa_job_done`` (migration 0003, ``ARCHIVE_FINISHED``), and a row there is
always finished. Completed jobs go straight into ``awa_job_done_current``, a
child of ``awa_job_done`` renamed and later dropped whole by maintenance
(migration 0016, *Finished segments*). Statements about live jobs (claims,
outcomes, heartbeats, rescue) therefore read ``ONLY awa_job``; those that may
meet a finished job (retry, pruning, callbacks answered twice, the admin)
name ``awa_job`` or ``awa_job_done`` and read every child.
"""

from __future__ import annotations

from collections.abc import Iterable

from .models import ERROR_LINE_SQL, Job, JobState

JOB_COLUMNS = ", ".join(f'"{f.column}"' for f in Job._meta.concrete_fields)
J_JOB_COLUMNS = ", ".join(f'j."{f.column}"' for f in Job._meta.concrete_fields)

# ==== Channels, LISTEN and NOTIFY ====

# -- NOTIFY_CHANNEL, CANCEL_CHANNEL, LIMITS_CHANNEL --
# The LISTEN/NOTIFY channels. On NOTIFY_CHANNEL the payload is a queue name:
# a job became available there (INSERT_ONE, NOTIFY_QUEUES). On CANCEL_CHANNEL
# it is a job id whose running attempt was cancelled (NOTIFY_CANCEL). On
# LIMITS_CHANNEL it is a queue name whose runtime limits changed
# (NOTIFY_LIMITS).
NOTIFY_CHANNEL = "awa_job"
CANCEL_CHANNEL = "awa_cancel"
LIMITS_CHANNEL = "awa_limits"

# -- LISTEN_JOBS, LISTEN_CANCELS --
# The worker's listener subscribes to both channels, on a psycopg connection
# of its own in autocommit (a LISTEN lasts as long as the session, and
# notifications reach it only between transactions). A channel is an
# identifier, which LISTEN takes no parameter for: these are fixed names.
LISTEN_JOBS = f"LISTEN {NOTIFY_CHANNEL}"
LISTEN_CANCELS = f"LISTEN {CANCEL_CHANNEL}"
LISTEN_LIMITS = f"LISTEN {LIMITS_CHANNEL}"

# -- LISTENER_PING --
# Sent by the listener after a quiet second, so a connection that died
# without a word fails now and is opened again. Reads nothing, locks nothing.
LISTENER_PING = "SELECT 1"

# -- NOTIFY_CANCEL --
# Tell the worker running a job that it was cancelled (awa.cancel, inside its
# transaction: delivered at commit, not at all on rollback). No lock.
NOTIFY_CANCEL = f"SELECT pg_notify('{CANCEL_CHANNEL}', %(job_id)s)"


def _states(states: Iterable[JobState]) -> str:
    """A group of states as the SQL list ``('completed', 'failed', ...)``."""
    return "(" + ", ".join(f"'{state}'" for state in states) + ")"


# The JobState groups, in their order: partial indexes name them in the same
# words (their predicate must match the statement's for the index to serve).
_FINAL = _states(JobState.FINAL)
_DELAYED = _states(JobState.DELAYED)


def _backoff(attempt: str) -> str:
    """Seconds before the retry after failed run number ``attempt`` (SPEC §5): 2**n
    plus a random 0 to 25% of that, at most a day. Every retry that waits a backoff
    is scheduled with it (a handler's error, a rescue, a pending follow-up);
    random() is drawn per row, so jobs that failed together retry apart."""
    return f"least(power(2, least({attempt}, 32)) * (1 + random() * 0.25), 86400)"


def _errors_plus(row: str, error: str, traceback: str = "''") -> str:
    """The ``errors`` column of ``row`` (``"j."``, or ``""`` for the updated table)
    with an entry ``{"attempt", "at", "error", "traceback"}`` appended for the
    row's current attempt, stamped with the database clock; unchanged when
    ``error`` is NULL."""
    return f"""CASE WHEN {error} IS NULL THEN {row}errors
                  ELSE {row}errors || jsonb_build_array(jsonb_build_object(
                      'attempt', {row}attempt, 'at', now(), 'error', {error},
                      'traceback', {traceback})) END"""


def _key_held_elsewhere(row: str) -> str:
    """Whether another job holds ``row``'s unique key now: it is in one of its own
    ``unique_states`` (the predicate of awa_job_unique_idx, which serves the search).
    A row moving into a state its key is held in would break the index then."""
    return f"""EXISTS (SELECT 1 FROM ONLY awa_job AS h
                WHERE h.unique_key = {row}.unique_key AND h.unique_states ? h.state
                  AND h.id <> {row}.id)"""


# What an attempt leaves on the row once it is over and nothing waits on it:
# no heartbeat, no deadline, no callback.
_ATTEMPT_CLEARED = (
    "heartbeat_at = NULL, deadline_at = NULL, callback_id = NULL, callback_timeout_at = NULL"
)

# ==== Enqueueing (enqueueing.py) ====

_INSERT_COLUMNS = (
    "kind, queue, args, state, priority, max_attempts, run_at, tags, metadata, "
    "unique_key, unique_states"
)

# -- INSERT_ONE --
# Enqueue one job inside the caller's transaction. Unique jobs go through
# INSERT_ONE_UNIQUE instead, whose ON CONFLICT names the partial unique index
# awa_job_unique_idx so a conflict returns no row rather than aborting the
# caller's transaction. pg_notify wakes idle workers of the queue when the
# caller commits (Postgres delivers NOTIFY at commit, and not on rollback).
# It returns only what the server decides (INSERTED_COLUMNS): the caller
# knows the rest, and sending back and parsing the whole row would be a good
# part of an enqueue's cost.
# -- INSERT_ONE_QUIET, INSERT_ONE_UNIQUE_QUIET --
# The same without the NOTIFY (its column is NULL), for the engine's own
# transactions, which wake the queue after their commit (wakeups.py).
INSERTED_COLUMNS = ("id", "state", "run_at", "created_at")
_INSERT_ONE = f"""
INSERT INTO awa_job ({_INSERT_COLUMNS})
VALUES (%(kind)s, %(queue)s, %(args)s::jsonb,
        CASE WHEN %(run_at)s::timestamptz > now() THEN 'scheduled' ELSE 'available' END,
        %(priority)s, %(max_attempts)s, coalesce(%(run_at)s::timestamptz, now()),
        %(tags)s::jsonb, %(metadata)s::jsonb, %(unique_key)s, %(unique_states)s::jsonb)
{{on_conflict}}
RETURNING {", ".join(INSERTED_COLUMNS)},
          {{notify}}
"""
_NOTIFY_AVAILABLE = f"CASE WHEN state = 'available' THEN pg_notify('{NOTIFY_CHANNEL}', queue) END"
UNIQUE_CONFLICT_CLAUSE = (
    "ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND unique_states ? state DO NOTHING"
)
INSERT_ONE_UNIQUE = _INSERT_ONE.format(on_conflict=UNIQUE_CONFLICT_CLAUSE, notify=_NOTIFY_AVAILABLE)
INSERT_ONE = _INSERT_ONE.format(on_conflict="", notify=_NOTIFY_AVAILABLE)
INSERT_ONE_UNIQUE_QUIET = _INSERT_ONE.format(on_conflict=UNIQUE_CONFLICT_CLAUSE, notify="NULL")
INSERT_ONE_QUIET = _INSERT_ONE.format(on_conflict="", notify="NULL")

# -- FIND_UNIQUE_HOLDER --
# After a unique conflict: which job holds the key (for the error message).
FIND_UNIQUE_HOLDER = """
SELECT id FROM awa_job
WHERE unique_key = %(unique_key)s AND unique_states ? state
LIMIT 1
"""

# -- RESERVE_IDS --
# Draw ids for a bulk insert up front, so the ids returned follow the input
# order even when unique duplicates are skipped. The sequence is looked up
# once (a MATERIALIZED CTE): as a nextval() argument pg_get_serial_sequence
# ran for every id, and took most of the statement's time.
RESERVE_IDS = """
WITH s AS MATERIALIZED (SELECT pg_get_serial_sequence('awa_job', 'id')::regclass AS seq)
SELECT nextval(s.seq) FROM s, generate_series(1, %(n)s)
"""

# -- INSERT_MANY --
# Bulk enqueue in one statement from parallel arrays.
# ON CONFLICT ... DO NOTHING skips unique duplicates, including duplicates
# within the batch itself.
INSERT_MANY = f"""
INSERT INTO awa_job (id, {_INSERT_COLUMNS})
SELECT d.id, d.kind, d.queue, d.args,
       CASE WHEN d.run_at > now() THEN 'scheduled' ELSE 'available' END,
       d.priority, d.max_attempts,
       coalesce(d.run_at, now()),
       d.tags, d.metadata, d.unique_key, d.unique_states
FROM unnest(%(id)s::bigint[], %(kind)s::text[], %(queue)s::text[], %(args)s::jsonb[],
            %(priority)s::smallint[], %(max_attempts)s::smallint[],
            %(run_at)s::timestamptz[], %(tags)s::jsonb[], %(metadata)s::jsonb[],
            %(unique_key)s::text[], %(unique_states)s::jsonb[])
     AS d(id, kind, queue, args, priority, max_attempts, run_at, tags, metadata,
          unique_key, unique_states)
{UNIQUE_CONFLICT_CLAUSE}
RETURNING id
"""

# -- COPY_AVAILABLE --
# Bulk enqueue of jobs to run now, streamed with COPY (ids drawn beforehand
# with RESERVE_IDS). state and run_at take their defaults: available, now().
_COPY_COLUMNS = "kind, queue, args, priority, max_attempts, tags, metadata"
COPY_AVAILABLE = f"COPY awa_job (id, {_COPY_COLUMNS}) FROM STDIN"

# -- COPY_AVAILABLE_UNNUMBERED --
# The same, for jobs whose ids nobody asked for: id takes its default too.
COPY_AVAILABLE_UNNUMBERED = f"COPY awa_job ({_COPY_COLUMNS}) FROM STDIN"

# -- NOTIFY_QUEUES --
# Wake workers of these queues at commit. Postgres folds identical
# notifications within one transaction into one.
NOTIFY_QUEUES = f"SELECT pg_notify('{NOTIFY_CHANNEL}', q) FROM unnest(%(queues)s::text[]) AS q"

# -- NOTIFY_LIMITS --
# A queue's runtime limits changed (set_queue_limits): its producers read them
# again at once, rather than at their next poll interval. Sent at the caller's
# commit, as any NOTIFY.
NOTIFY_LIMITS = f"SELECT pg_notify('{LIMITS_CHANNEL}', %(queue)s)"

# -- NOTIFY_QUEUES_AFTER --
# Wake workers of these queues after the engine's own transaction committed
# (wakeups.notify_now, and the listener sending a worker's outbox): run as a
# transaction of its own, which commits without waiting for its WAL flush
# (set_config(..., true): for this transaction only).
# A NOTIFY's commit holds PostgreSQL's notification lock through its flush;
# this one's holds it for no flush. Losing it in a crash loses only a hint.
NOTIFY_QUEUES_AFTER = f"""
SELECT set_config('synchronous_commit', 'off', true), pg_notify('{NOTIFY_CHANNEL}', q)
FROM unnest(%(queues)s::text[]) AS q
"""

# ==== Flow control (producer.py, SPEC 12) ====


def _sequence_free(row: str) -> str:
    """True for a ``row`` that is no sequence's member, or whose sequence has no
    unfinished member before it (in id order: enqueue order). A member unfinished in
    any state (scheduled, retryable, running...) holds the ones after it. No lock:
    an earlier member leaves the unfinished states only by a committed finalize,
    so two claimers can at worst both pass a member over, never both start two.
    Index: awa_job_sequence_idx ((metadata ->> 'awa_sequence'), id) WHERE
    metadata ? 'awa_sequence' AND state NOT IN the finished states (this
    predicate, word for word, so the planner uses it): one entry read per probe.

    A member retried after it finished (``RETRIED_KEY``, set by RETRY_JOBS and
    REOPEN_CASCADED) is back in its place while a later member may be running,
    one that started while it was finished: it also waits for that one to end.
    Only such a member reads its key's later members.

    A member cancelled while its handler may still run in a live worker keeps its
    key's place (``_sequence_held``) until that handler returns."""
    return f"""(NOT {row}.metadata ? 'awa_sequence' OR (NOT {_member_of(row, "s.id < {row}.id")}
          AND (NOT {row}.metadata ? '{RETRIED_KEY}'
               OR NOT {_member_of(row, "s.id > {row}.id AND s.state = 'running'")})
          AND NOT {_sequence_held(row)}))"""


def _member_of(row: str, where: str) -> str:
    """True while a live member of ``row``'s sequence matches ``where`` (on ``s``), read
    through awa_job_sequence_idx, whose predicate this repeats word for word."""
    return f"""EXISTS (
            SELECT 1 FROM ONLY awa_job AS s
            WHERE s.metadata ? 'awa_sequence'
              AND (s.metadata ->> 'awa_sequence') = ({row}.metadata ->> 'awa_sequence')
              AND s.state NOT IN {_FINAL} AND {where.format(row=row)})"""


# The awa_limit_lease kind of a sequence's place kept for a cancelled member's
# handler (no kind can be named so: kinds.KIND_RE). Its key is the sequence key,
# its slot 0, its attempt the cancelled one's; held_until is always set.
SEQUENCE_HOLD_KIND = "#sequence"


def _sequence_held(row: str) -> str:
    """True while ``row``'s sequence key has a place kept (``held_until`` ahead) for
    the handler of a cancelled member that may still run (CANCEL_JOBS): renewed by
    its worker while it runs, deleted when it returns (RELEASE_HELD_LEASES), run out
    within STALE_AFTER once its worker is gone. Index: awa_limit_lease_unique."""
    return f"""EXISTS (
            SELECT 1 FROM awa_limit_lease AS sh
            WHERE sh.kind = '{SEQUENCE_HOLD_KIND}'
              AND sh.key = ({row}.metadata ->> 'awa_sequence') AND sh.held_until > now())"""


# The metadata key of a sequence member retried after it finished (_sequence_free).
RETRIED_KEY = "awa_sequence_retried"
# What a retry or a reopening sets on a row's metadata: the key above on a member.
_RETRIED_MARK = f"""CASE WHEN metadata ? 'awa_sequence'
        THEN jsonb_build_object('{RETRIED_KEY}', true) ELSE '{{}}'::jsonb END"""


def _limit_key(row: str, limit: str = "kl.v") -> str:
    """The ``Limit(by=)`` values of ``row`` as JSON text (``''`` without ``by``, or
    without a limit), from its kind's entry ``limit`` (``kl.v``). One field (the
    common case) is an expression; more take a subquery, which costs several times
    as much for each row a claim reads. Both give the same text: ``'["a"]'``, the
    text of the JSON array of the values (a missing field is ``null``), written
    as jsonb writes an array: each value's own text, ``", "`` between them. The
    one-field form joins that text itself: building the array and writing it out
    (``jsonb_build_array(...)::text``, the same text) cost a CLAIM_KEYED that read
    past 19,000 rows of keys at their limit 17.7 ms of backend CPU, against 15.0."""
    return f"""CASE WHEN jsonb_array_length({limit} -> 'by') = 1
              THEN '[' || coalesce(({row}.args -> ({limit} -> 'by' ->> 0))::text, 'null') || ']'
              ELSE coalesce((SELECT jsonb_agg({row}.args -> b.f ORDER BY b.o)::text
              FROM jsonb_array_elements_text({limit} -> 'by') WITH ORDINALITY AS b(f, o)), '')
              END"""


# The longest limit key (its text, in bytes) a lease keeps as it is: awa_limit_lease_unique
# is a btree, whose entries (kind, key and slot) hold at most 2,704 bytes. A longer key
# (a long by= value) is kept as its digest, one per value: as it was, its lease
# could not be written, and the claim that wrote it failed, every claim of its
# queue, so one such job stalled all of them. Only where a lease is looked up or
# written (a row per fitting key), never per candidate.
MAX_LEASE_KEY = 2000


def _lease_key(key: str) -> str:
    """The ``awa_limit_lease.key`` of the limit key ``key`` (``_limit_key``'s text)."""
    return f"""(CASE WHEN octet_length({key}) <= {MAX_LEASE_KEY} THEN {key}
              ELSE 'sha256:' || encode(sha256(convert_to({key}, 'UTF8')), 'hex') END)"""


# A candidate c's kind limit, looked up in the %(kinds)s object itself: no join,
# so the candidates' scan keeps awa_job_claim_idx's order and stops at its LIMIT
# whatever the planner's statistics say (a join with kl let a table without
# them be read whole and sorted, every claim).
_KIND_LIMIT = "(%(kinds)s::jsonb -> c.kind::text)"


# -- LOCK_LIMITS --
# Serialize the limited claims that could exceed one limit together: a
# transaction-scoped advisory lock per limited queue ("q:<name>"; a kind's
# awa.Limit holds on the queue it is declared on, whose claims it serializes),
# several in hash order. Only limited
# claimers of that queue take it: unlimited claims, finalize,
# heartbeats and maintenance never wait here. The claim that follows in the
# same transaction takes its snapshot after the lock, so it sees every
# attempt the previous holder started (it committed before it let go). No
# counter row: what is running is counted from the rows themselves.
# The claimers do not queue for it: each tries (pg_try_advisory_xact_lock),
# and one that finds it held claims nothing this round and comes back when
# woken (a finishing attempt of the queue wakes its claimers) or shortly after
# (producer.LOCKED_RETRY): the holder is claiming what is free right now, and
# a queue of waiters would each take the lock only to find less room than it
# waited for. Returns whether every lock was taken (those that were are let
# go when the transaction ends), and the database's clock then: a rated claim
# tells how long the server took from there to its stamp, planning included
# (producer._stamped_after).
LIMIT_LOCK_NAMESPACE = 0x617761  # "awa"
LOCK_LIMITS = f"""
SELECT coalesce(bool_and(pg_try_advisory_xact_lock({LIMIT_LOCK_NAMESPACE}, s.h)), true),
       clock_timestamp()
FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(%(keys)s::text[]) AS k ORDER BY 1) AS s
"""

# ---- Slot leases of global_concurrency queues (slots.py) ----
# A queue's N places are rows of awa_queue_slot numbered 1..N, unique per
# (queue, slot): a worker process runs at most as many of the queue's handlers
# as it holds, and claims with the plain CLAIM (no advisory lock, no count of
# running rows per claim). Taken and given back by each worker's producer a
# few times per poll interval, never by a claim or a finalize, so no row is
# locked in turn at the pace of jobs. A slot is held while its worker's row in
# awa_worker is live: a dead worker's slots are taken over at STALE_AFTER, the
# age at which its attempts are rescued.

# -- FREE_STALE_SLOTS --
# The slots of %(queue)s whose worker's row is gone or STALE_AFTER old.
# Index: awa_queue_slot_unique (a queue's few rows); awa_worker by primary key.
FREE_STALE_SLOTS = """
DELETE FROM awa_queue_slot AS s
WHERE s.queue = %(queue)s AND NOT EXISTS (
    SELECT 1 FROM awa_worker AS w
    WHERE w.id = s.worker_id AND w.last_seen_at >= now() - make_interval(secs => %(stale_after)s))
"""

# -- TAKE_SLOTS --
# Take up to %(want)s free slots of %(queue)s numbered 1..%(conc)s for worker
# %(worker)s, lowest first; returns the numbers taken. A slot another worker
# takes at the same moment is skipped (ON CONFLICT on the unique (queue,
# slot): the insert waits for that transaction only if it inserted the same
# number). Takes none while any slot above %(conc)s is held (a lowered limit:
# they are given back as their handlers finish). The first slots of a queue
# whose slots are all free are no more than the limit less the attempts
# running: those started before the queue was limited hold their places until
# they end. Later takes count the slots only (a row stays running a few
# milliseconds, under a burst longer, after its handler returned and its slot
# went to the next job). Only a worker whose own row is live takes any.
# Index: awa_queue_slot_unique; the queue's running rows (awa_job_running_idx).
TAKE_SLOTS = """
WITH n AS (
    SELECT count(*) AS leased, count(*) FILTER (WHERE slot > %(conc)s) AS over
    FROM awa_queue_slot WHERE queue = %(queue)s
),
r AS (
    SELECT count(*) AS running FROM ONLY awa_job WHERE state = 'running' AND queue = %(queue)s
)
INSERT INTO awa_queue_slot (queue, slot, worker_id, taken_at)
SELECT %(queue)s, g.s, %(worker)s, now()
FROM generate_series(1, %(conc)s::int) AS g(s)
WHERE NOT EXISTS (SELECT 1 FROM awa_queue_slot AS x WHERE x.queue = %(queue)s AND x.slot = g.s)
  AND EXISTS (SELECT 1 FROM awa_worker AS w WHERE w.id = %(worker)s
              AND w.last_seen_at >= now() - make_interval(secs => %(stale_after)s))
ORDER BY g.s
LIMIT (SELECT CASE WHEN n.over > 0 THEN 0
                   ELSE greatest(0, least(%(want)s::int, %(conc)s::int
                        - CASE WHEN n.leased = 0 THEN r.running ELSE n.leased END)) END
       FROM n, r)
ON CONFLICT DO NOTHING
RETURNING slot
"""

# -- SLOT_STATE --
# What worker %(worker)s holds of %(queue)s's slots (its numbers), how many
# slots the fleet holds, whether any is above %(conc)s, and how many live
# workers serve the queue (for a fair share). awa_worker: one row per process.
SLOT_STATE = """
SELECT (SELECT coalesce(array_agg(slot ORDER BY slot), '{}') FROM awa_queue_slot
        WHERE queue = %(queue)s AND worker_id = %(worker)s),
       (SELECT count(*) FROM awa_queue_slot WHERE queue = %(queue)s),
       EXISTS (SELECT 1 FROM awa_queue_slot WHERE queue = %(queue)s AND slot > %(conc)s),
       (SELECT count(*) FROM awa_worker
        WHERE queues ? %(queue)s
          AND last_seen_at >= now() - make_interval(secs => %(stale_after)s))
"""

# -- GIVE_SLOTS --
# Worker %(worker)s gives back slots %(slots)s of %(queue)s (none of them in use).
GIVE_SLOTS = """
DELETE FROM awa_queue_slot
WHERE queue = %(queue)s AND worker_id = %(worker)s AND slot = ANY(%(slots)s::int[])
"""

# The limited claim's parts, shared with HELD_BACK. Parameters: %(queue)s;
# %(scope)s ("q:<queue>"); %(kinds)s, the kind limits as registry.limits_json()
# gives them; %(q_conc)s, %(q_rate_count)s, %(q_rate_period)s, the queue's
# limits in AWA["QUEUES"] (NULL: none), which awa_queue.limits overrides key
# by key; %(leased)s, true when the worker's slot leases keep the queue's
# global_concurrency (its claims then leave it to them); %(limit)s, the most
# to take; %(scan)s, the most candidates to rank; %(start_within)s, how long
# after its claim's stamp a claimed attempt's handler may still start (the
# worker gives back unstarted what it could not start by then).
#   t: the clock after LOCK_LIMITS (now() is the transaction's start, before
#      the lock wait); starts are stamped with it.
#   room: what the queue may start: its free global slots and what its rate
#      allows in the window now, 0 if paused.
#   used: per limited kind and Limit(by=) key, attempts running (fleet-wide,
#      from the running rows: awa_job_running_idx) and started in its window.
#   A rate's window is counted over its period and %(start_within)s: the
#   stamps are the claims', and each handler starts within that much after
#   its stamp, so no window of the period holds more than N handler starts
#   (a burst claimed at the end of one window may start in the next).
#   saturated: the kind and Limit(by=) keys at their limit now.
#   cand: the due available rows in claim order (awa_job_claim_idx), passing
#      over sequence members that must wait and rows of a saturated key (a
#      hashed NOT IN), so a busy key's backlog does not fill the candidates.
#      One index scan in claim order, stopped at %(scan)s rows.
#   fits: each key's first (limit - used) candidates, in claim order, up to room;
#      with its key's rank (nth) and concurrency limit (conc, NULL: none).
_LIMITED_PARTS = f"""
WITH t AS MATERIALIZED (SELECT clock_timestamp() AS now),
kl AS MATERIALIZED (SELECT key AS kind, value AS v FROM jsonb_each(%(kinds)s::jsonb)),
q AS MATERIALIZED (
    SELECT CASE WHEN %(leased)s::bool THEN NULL
                WHEN o.limits ? 'global_concurrency'
                THEN (o.limits ->> 'global_concurrency')::int ELSE %(q_conc)s::int END AS conc,
           CASE WHEN o.limits ? 'rate_limit'
                THEN (o.limits ->> 'rate_count')::int ELSE %(q_rate_count)s::int END AS rate_count,
           CASE WHEN o.limits ? 'rate_limit'
                THEN (o.limits ->> 'rate_period')::float8
                ELSE %(q_rate_period)s::float8 END AS rate_period,
           coalesce(o.paused, false) AS paused
    FROM (SELECT 1) AS one LEFT JOIN awa_queue AS o ON o.name = %(queue)s
),
room AS MATERIALIZED (
    SELECT CASE WHEN q.paused THEN 0 ELSE greatest(0, least(
        %(limit)s::int,
        q.conc - (SELECT count(*) FROM ONLY awa_job AS r
                  WHERE r.state = 'running' AND r.queue = %(queue)s),
        q.rate_count - CASE WHEN q.rate_count IS NOT NULL THEN (
            SELECT count(*) FROM awa_attempt_start AS a
            WHERE a.scope = %(scope)s
              AND a.started_at > t.now - make_interval(
                  secs => q.rate_period + %(start_within)s::float8)) END
    )) END AS n
    FROM q, t
),
used AS MATERIALIZED (
    SELECT u.kind, u.gkey, sum(u.running)::int AS running, sum(u.started)::int AS started
    FROM (
        SELECT r.kind, {_limit_key("r")} AS gkey, 1 AS running, 0 AS started
        FROM ONLY awa_job AS r JOIN kl ON kl.kind = r.kind
        WHERE r.state = 'running'
        UNION ALL
        SELECT kl.kind, a.key, 0, 1
        FROM kl CROSS JOIN t
        JOIN awa_attempt_start AS a ON a.scope = 'k:' || kl.kind
        WHERE kl.v ? 'rn' AND a.started_at > t.now - make_interval(
            secs => (kl.v ->> 'rs')::float8 + %(start_within)s::float8)
    ) AS u
    GROUP BY u.kind, u.gkey
),
saturated AS MATERIALIZED (
    SELECT u.kind, u.gkey FROM used AS u JOIN kl ON kl.kind = u.kind
    WHERE (kl.v ? 'c' AND u.running >= (kl.v ->> 'c')::int)
       OR (kl.v ? 'rn' AND u.started >= (kl.v ->> 'rn')::int)
),
cand AS MATERIALIZED (
    SELECT c.id, c.priority, c.run_at, c.kind, c.gkey, c.v,
           coalesce(u.running, 0) AS running, coalesce(u.started, 0) AS started
    FROM (
        SELECT c.id, c.priority, c.run_at, c.kind::text AS kind,
               %(kinds)s::jsonb -> c.kind::text AS v, {_limit_key("c", _KIND_LIMIT)} AS gkey
        FROM ONLY awa_job AS c
        WHERE c.state = 'available' AND c.queue = %(queue)s AND c.run_at <= now()
          AND {_sequence_free("c")}
          AND (c.kind::text, {_limit_key("c", _KIND_LIMIT)}) NOT IN (
              SELECT f.kind, f.gkey FROM saturated AS f)
        ORDER BY c.priority, c.run_at, c.id
        LIMIT %(scan)s
    ) AS c
    LEFT JOIN used AS u ON u.kind = c.kind AND u.gkey = c.gkey
),
fits AS (
    SELECT r.id, r.kind, r.gkey, r.nth, (r.v ->> 'c')::int AS conc FROM (
        SELECT c.*, row_number() OVER (
            PARTITION BY c.kind, c.gkey ORDER BY c.priority, c.run_at, c.id) AS nth
        FROM cand AS c
    ) AS r
    WHERE r.v IS NULL
       OR ((NOT r.v ? 'c' OR r.running + r.nth <= (r.v ->> 'c')::int)
           AND (NOT r.v ? 'rn' OR r.started + r.nth <= (r.v ->> 'rn')::int))
    ORDER BY r.priority, r.run_at, r.id
    LIMIT (SELECT n FROM room)
)"""

# Whether lease l (awa_limit_lease, see *Per-key leases* below) is held: its
# attempt (job x, run_lease) is running, or is newer than the reader's snapshot
# (x's claim committed after it: x.run_lease, as the snapshot shows it, is
# below the lease's). A lease and the claim of its
# attempt commit together, so a snapshot that shows the lease shows the claim;
# only ON CONFLICT DO UPDATE, which reads the newest version of the row it
# conflicts with, can see a lease from after its snapshot: it counts as held.
# A job row that is gone (completed into awa_job_done, or deleted) holds none.
# Primary key lookup, one per lease: a scalar subquery, which the planner keeps
# as such (an EXISTS it turns into a join, and without statistics it chose a
# sequential scan of awa_job to hash against every lease).
# Also held, whatever its row says, while its held_until is ahead: a cancel or
# a rescue took its attempt out of running while the handler still ran in a
# live worker, which renews it until the handler returns (_released below).
_LEASE_HELD = """(coalesce({l}.held_until > now(), false) OR coalesce((
            SELECT true FROM ONLY awa_job AS x WHERE x.id = {l}.job_id
              AND (x.run_lease < {l}.run_lease
                   OR (x.run_lease = {l}.run_lease AND x.state = 'running'))), false))"""

# -- CLAIM_LIMITED --
# The claim of a queue under limits (its own, or its kinds' awa.Limit), run
# after LOCK_LIMITS in one transaction; the parameters of _LIMITED_PARTS, and
# CLAIM's deadlines. Still one statement per batch: it ranks the candidates
# (above), locks the fitting rows with SKIP LOCKED (an unlimited claimer of the
# same queue, an operator, a keyed claimer), starts their attempts as CLAIM
# does, and records each start in awa_attempt_start (for the queue, and for the
# kind when it has a rate). A job held back is not touched: it stays
# available, its attempt unused.
# An attempt of a kind with a concurrency limit also takes its key's lease, as
# CLAIM_KEYED's do (free, leased: the same slots, the same order, the same
# takeover of a stale lease), and starts only if it got one. The queue's lock
# serializes the claimers under it, not a CLAIM_KEYED claimer of the same
# queue: one whose settings have no rate, or that has not read a rate set or
# cleared at runtime yet (within a poll interval). Each sees only the
# committed attempts of the other, but both insert the key's slot, and the
# unique index makes the second wait for the first's commit and find the
# slot held: so a key never runs more than c at once, whatever mix of
# claimers, and every running attempt of such a kind holds a lease, released
# on every way out of running whichever statement claimed it.
#   free: of the slots 1..c of each fitting key, those no held lease has
#      (awa_limit_lease_unique), in order; the key's n-th fitting candidate
#      gets the n-th (a running attempt without a lease, from an earlier
#      build, still counts against c in fits).
#   picked: the fitting rows, locked (SKIP LOCKED) before their leases are
#      inserted, so a lease is only ever taken for a row this claim starts.
#   leased: their leases, inserted in (kind, key, slot) order.
#   started: the picked rows that need no lease or got one.
CLAIM_LIMITED = f"""{_LIMITED_PARTS},
free AS (
    SELECT k.kind, k.gkey, g.s AS slot,
           row_number() OVER (PARTITION BY k.kind, k.gkey ORDER BY g.s) AS nth
    FROM (SELECT DISTINCT kind, gkey, conc FROM fits WHERE conc IS NOT NULL) AS k
    CROSS JOIN LATERAL generate_series(1, k.conc) AS g(s)
    LEFT JOIN awa_limit_lease AS l
        ON l.kind = k.kind AND l.key = {_lease_key("k.gkey")} AND l.slot = g.s
    WHERE l.id IS NULL OR NOT {_LEASE_HELD.format(l="l")}
),
picked AS (
    SELECT j.id, j.run_lease FROM ONLY awa_job AS j
    WHERE j.id IN (SELECT id FROM fits) AND j.state = 'available'
    FOR UPDATE OF j SKIP LOCKED
),
leased AS (
    INSERT INTO awa_limit_lease AS l (kind, key, slot, job_id, run_lease, taken_at)
    SELECT f.kind, {_lease_key("f.gkey")}, s.slot, p.id, p.run_lease + 1, t.now
    FROM picked AS p JOIN fits AS f ON f.id = p.id
    JOIN free AS s ON s.kind = f.kind AND s.gkey = f.gkey AND s.nth = f.nth
    CROSS JOIN t
    ORDER BY 1, 2, 3
    ON CONFLICT (kind, key, slot) DO UPDATE
    SET job_id = excluded.job_id, run_lease = excluded.run_lease, taken_at = excluded.taken_at,
        held_until = NULL
    WHERE NOT {_LEASE_HELD.format(l="l")}
    RETURNING l.job_id
),
started AS (
    SELECT p.id FROM picked AS p JOIN fits AS f ON f.id = p.id WHERE f.conc IS NULL
    UNION ALL
    SELECT job_id FROM leased
),
claimed AS (
    UPDATE ONLY awa_job AS j
    SET state = 'running',
        attempt = j.attempt + CASE WHEN j.snoozed THEN 0 ELSE 1 END,
        snoozed = false,
        run_lease = j.run_lease + 1,
        attempted_at = NULL,
        heartbeat_at = t.now,
        deadline_at = t.now + make_interval(
            secs => coalesce((%(deadlines)s::jsonb ->> j.kind)::float8,
                             %(default_deadline)s::float8)),
        callback_id = NULL,
        callback_timeout_at = NULL
    FROM started, t
    WHERE j.id = started.id
    RETURNING {J_JOB_COLUMNS}
),
logged AS (
    INSERT INTO awa_attempt_start (scope, key, started_at)
    SELECT %(scope)s, '', t.now FROM claimed CROSS JOIN t
    UNION ALL
    SELECT 'k:' || c.kind, {_limit_key("c")}, t.now
    FROM claimed AS c JOIN kl ON kl.kind = c.kind CROSS JOIN t
    WHERE kl.v ? 'rn'
)
SELECT {JOB_COLUMNS} FROM claimed
"""

# -- HELD_BACK --
# For the admin: how many of a queue's due available jobs a limit (or a
# sequence) holds back right now: those due (parked sequence members too),
# less those a claim could take.
# The parameters of _LIMITED_PARTS, with %(limit)s and %(scan)s large. Reads only.
HELD_BACK = f"""{_LIMITED_PARTS}
SELECT (SELECT count(*) FROM ONLY awa_job
        WHERE state = 'available' AND queue = %(queue)s
          AND (run_at <= now() OR metadata ? 'awa_sequence_run_at'))
     - (SELECT count(*) FROM fits)
"""

# -- LIMITS_DIAGNOSIS --
# Under DEBUG, after a limited claim took nothing: the queue's room, its due
# jobs, the candidates not at a limit, and those that would fit. Reads only.
LIMITS_DIAGNOSIS = f"""{_LIMITED_PARTS}
SELECT (SELECT n FROM room),
       (SELECT count(*) FROM ONLY awa_job
        WHERE state = 'available' AND queue = %(queue)s
          AND (run_at <= now() OR metadata ? 'awa_sequence_run_at')),
       (SELECT count(*) FROM cand),
       (SELECT count(*) FROM fits)
"""

# -- HAS_SEQUENCED --
# For the admin: whether an unlimited queue has due sequence members (which
# may be held back). Index: awa_job_sequence_idx, then the row.
HAS_SEQUENCED = """
SELECT 1 FROM ONLY awa_job
WHERE metadata ? 'awa_sequence' AND state = 'available' AND queue = %(queue)s
LIMIT 1
"""

# -- QUEUE_LIMITS --
# The limits set at runtime for one queue (set_queue_limits); the producer reads
# them once per poll interval to know whether its queue is limited. Primary key.
QUEUE_LIMITS = "SELECT limits FROM awa_queue WHERE name = %(queue)s"


def _first_unfinished(key: str, column: str = "id", besides: str = "") -> str:
    """The lateral subquery ``h`` of sequence ``key``'s first unfinished member (in id
    order), giving its ``column``; ``besides``, more conditions on the member ``s``.
    Index: awa_job_sequence_idx, whose predicate this repeats word for word."""
    return f"""CROSS JOIN LATERAL (
        SELECT s.{column} FROM ONLY awa_job AS s
        WHERE s.metadata ? 'awa_sequence' AND (s.metadata ->> 'awa_sequence') = {key}
          AND s.state NOT IN {_FINAL}{besides}
        ORDER BY s.id LIMIT 1) AS h"""


# -- FREED_QUEUES --
# After attempts of limited queues or sequences finished (a commit of their
# outcome): the queues whose claimers to wake: those queues, and the queue of
# each sequence's next member (its first unfinished one, by
# awa_job_sequence_idx). The second column says whether other workers are told
# too (completer.notify_freed posts them to the outbox): a next member on one
# of this worker's own queues (%(local)s) is left to it, without a NOTIFY that
# would send every other worker to claim it too. A limited queue's freed
# capacity is announced to all: this worker may be full. Reads only.
FREED_QUEUES = f"""
SELECT x.q, x.q <> ALL(%(local)s::text[]) OR x.limited
FROM (
    SELECT q, bool_or(limited) AS limited FROM (
        SELECT unnest(%(queues)s::text[]) AS q, true AS limited
        UNION ALL
        SELECT h.queue, false FROM unnest(%(sequences)s::text[]) AS k
        {_first_unfinished("k", "queue")}
    ) AS u GROUP BY q
) AS x
"""

# -- PRUNE_ATTEMPT_STARTS --
# Maintenance: forget attempt starts older than every window that may read them
# (%(keep)s seconds, the longest rate of the settings and the registry, at
# least a minute for the admin's achieved rate; and any rate set at runtime).
# In batches, rows locked by nobody (insert-only). Index: awa_start_window_idx
# does not lead with started_at, so this reads the small table's heap.
PRUNE_ATTEMPT_STARTS = """
DELETE FROM awa_attempt_start WHERE id IN (
    SELECT id FROM awa_attempt_start
    WHERE started_at < now() - make_interval(secs => greatest(
        %(keep)s::float8,
        (SELECT max((limits ->> 'rate_period')::float8) FROM awa_queue)))
    LIMIT %(limit)s
)
"""

# -- ACHIEVED_RATE --
# For the admin: attempts of each queue started in the last minute. Limited
# queues log their starts (awa_attempt_start); for the others the rows tell
# (attempted_at of live rows, and of rows finished within the minute: one
# start per row, so a job retried within the minute counts once). Live rows
# are read from ONLY awa_job; finished ones, one final state at a time,
# through awa_job_finalized_idx (state, finalized_at) in both tables (with the
# three states at once the planner would read the whole index): a million
# finished rows in awa_job_done are not walked.
_FINISHED_WITHIN_A_MINUTE = "\n    UNION ALL".join(
    f"""
    SELECT queue FROM awa_job
    WHERE state = '{state}' AND finalized_at > now() - interval '60 seconds'
      AND attempted_at > now() - interval '60 seconds'"""
    for state in JobState.FINAL
)
ACHIEVED_RATE = f"""
SELECT substr(scope, 3), count(*) FROM awa_attempt_start
WHERE scope LIKE 'q:%%' AND started_at > now() - interval '60 seconds'
GROUP BY scope
UNION ALL
SELECT queue, count(*) FROM (
    SELECT queue FROM ONLY awa_job
    WHERE state NOT IN {_FINAL} AND attempted_at > now() - interval '60 seconds'
    UNION ALL{_FINISHED_WITHIN_A_MINUTE}
) AS started
WHERE queue <> ALL(%(limited)s::text[])
GROUP BY queue
"""

# -- CLAIM --
# Claim up to %(limit)s runnable jobs of one queue in one statement. The CTE
# takes row locks with SKIP LOCKED, so concurrent workers never get the same
# job and never wait on each other; the UPDATE starts a new attempt (a new
# run_lease). Index: awa_job_claim_idx (queue, priority, run_at, id) WHERE
# state = 'available'. A paused queue claims nothing. A member of a sequence
# whose earlier member is unfinished is passed over (_sequence_free; rows
# without a sequence key pay one key lookup in their small metadata).
# Deadlines come per kind as a JSON object of seconds, else the default.
# What a claim does to each row it picked: a new attempt (and run_lease).
_CLAIM_SET = """
SET state = 'running',
    attempt = j.attempt + CASE WHEN j.snoozed THEN 0 ELSE 1 END,
    snoozed = false,
    run_lease = j.run_lease + 1,
    attempted_at = NULL,
    heartbeat_at = now(),
    deadline_at = now() + make_interval(
        secs => coalesce((%(deadlines)s::jsonb ->> j.kind)::float8, %(default_deadline)s::float8)),
    callback_id = NULL,
    callback_timeout_at = NULL"""
# The rest of a claim, after the candidates it picks: the oldest first, locked
# rows skipped, each turned into a running attempt. The UPDATE finds the picked
# rows by primary key (= ANY of their ids): a join with the CTE let the planner
# hash it against a sequential scan of the whole table, finished rows and all.
_CLAIM_PICKED = f"""
    ORDER BY priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE ONLY awa_job AS j{_CLAIM_SET}
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING {J_JOB_COLUMNS}
"""


def _plain_claim(first: str = "", guard: str = "") -> str:
    """CLAIM's text, with a CTE ``first`` before its candidates and a ``guard`` line
    in their WHERE (CLAIM_UNFLUSHED)."""
    return f"""
WITH {first}picked AS (
    SELECT id FROM ONLY awa_job AS c
    WHERE state = 'available' AND queue = %(queue)s AND run_at <= now()
      AND NOT EXISTS (SELECT 1 FROM awa_queue WHERE name = %(queue)s AND paused)
{guard}      AND {_sequence_free("c")}{_CLAIM_PICKED}"""


CLAIM = _plain_claim()

# -- CLAIM_UNFLUSHED --
# CLAIM for a queue whose global_concurrency is kept by slot leases (slots.py),
# committing without waiting for its WAL flush (synchronous_commit off for its
# own transaction, as NOTIFY_QUEUES_AFTER). Such a claim takes at most the few
# places its process's slots have free (no prefetch), so each of them waited
# for one commit's flush between two jobs: most of the claim's time
# (pg_stat_activity: WALWrite and WALSync). The claim is visible to every other
# session at once; only a server crash before the next flush can lose it, and
# then the job is available again with its attempt unused, as if it had not
# been claimed. A handler that ran it meanwhile cannot write an outcome (its
# run_lease is gone), so the job runs again, as a rescued one would: at least
# once, as ever. An outcome's commit flushes the WAL before it, claims too.
# The first CTE turns the flush off (set_config(..., true): this transaction
# only); the candidates' EXISTS on it makes it run, once, before the scan (a CTE
# no part of the statement reads is never run).
CLAIM_UNFLUSHED = _plain_claim(
    "unflushed AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),\n",
    "      AND EXISTS (SELECT 1 FROM unflushed)\n",
)

# ---- Per-key leases of awa.Limit(concurrency=...) (CLAIM_KEYED, CLAIM_LIMITED) ----
# A queue whose only limits are its kinds' concurrency limits (no rate, no
# queue rate) is kept by leases: each attempt of a limited kind holds a lease
# row of awa_limit_lease, (kind, key, slot) unique with slot 1..c, taken in
# the claim statement itself. Its claimers take turns (producer.claim_keyed
# tries LOCK_LIMITS first, as CLAIM_LIMITED's do, and one that finds it held
# claims nothing this round), so each claim's snapshot sees the leases of the
# one before. The lock only spares wasted claims; the unique index is what
# keeps a key: two claims of one key at the same instant, even without the
# lock (as the tests run them), both insert its free slot, and the index makes
# the second wait for the first and find the slot held, so a key never runs
# more than c at once. Finalize and other queues never take the lock. The lease
# names its attempt (job_id, run_lease) and goes in the transaction that takes
# the attempt out of running (the RELEASING forms of FINALIZE and COMPLETE,
# RESCUE, CANCEL_JOBS). A lease whose attempt is no longer running (its job
# left running by another write, or deleted) is stale: a claim takes its slot
# over, and maintenance sweeps it (FREE_STALE_LEASES). A queue with a rate
# claims such kinds under its lock (CLAIM_LIMITED), taking the same leases.

# -- CLAIM_KEYED --
# The claim of a queue whose limits are its kinds' concurrency limits only, in
# one statement, run after LOCK_LIMITS in one transaction (see above; the
# statement is correct without it). Parameters: %(queue)s; %(kinds)s
# (registry.limits_json(): each entry has "c" and "by"); %(limit)s; %(scan)s;
# CLAIM's deadlines.
#   used: attempts running per limited (kind, key), from the rows (fleet-wide;
#      awa_job_running_idx); an attempt started without a lease counts too.
#   cand: the due available rows in claim order, passing over sequence members
#      that must wait and rows of a key at its limit, locked with SKIP LOCKED
#      (a concurrent claimer takes the next ones): awa_job_claim_idx.
#   free: of each candidate key's slots 1..c, those no held lease has
#      (awa_limit_lease_unique), in order.
#   fits: each key's n-th candidate gets its n-th free slot, while n is within
#      c less what runs; rows of kinds without a limit need none.
#   leased: the leases inserted in (kind, key, slot) order (claimers that meet
#      wait on each other in one order: no deadlock); a slot whose lease is
#      stale is taken over (DO UPDATE ... WHERE), one held by an attempt that
#      started since this snapshot is not: that candidate stays available,
#      its attempt unused, for the next claim.
# Then as CLAIM: the rows that got a lease (or need none) start an attempt.
# A lowered limit: slots above it are never taken again and what runs counts
# against the new limit, so the key falls to it as its attempts end.
CLAIM_KEYED = f"""
WITH kl AS MATERIALIZED (SELECT key AS kind, value AS v FROM jsonb_each(%(kinds)s::jsonb)),
used AS MATERIALIZED (
    SELECT r.kind::text AS kind, {_limit_key("r")} AS gkey, count(*)::int AS running
    FROM ONLY awa_job AS r JOIN kl ON kl.kind = r.kind
    WHERE r.state = 'running'
    GROUP BY 1, 2
),
saturated AS MATERIALIZED (
    SELECT u.kind, u.gkey FROM used AS u JOIN kl ON kl.kind = u.kind
    WHERE u.running >= (kl.v ->> 'c')::int
),
cand AS MATERIALIZED (
    SELECT c.id, c.priority, c.run_at, c.run_lease, c.kind::text AS kind,
           ({_KIND_LIMIT} ->> 'c')::int AS conc, {_limit_key("c", _KIND_LIMIT)} AS gkey
    FROM ONLY awa_job AS c
    WHERE c.state = 'available' AND c.queue = %(queue)s AND c.run_at <= now()
      AND NOT EXISTS (SELECT 1 FROM awa_queue WHERE name = %(queue)s AND paused)
      AND {_sequence_free("c")}
      AND (c.kind::text, {_limit_key("c", _KIND_LIMIT)}) NOT IN (
          SELECT f.kind, f.gkey FROM saturated AS f)
    ORDER BY c.priority, c.run_at, c.id
    LIMIT %(scan)s
    FOR UPDATE OF c SKIP LOCKED
),
ranked AS MATERIALIZED (
    SELECT c.*, c.conc - coalesce(u.running, 0) AS room, row_number() OVER (
               PARTITION BY c.kind, c.gkey ORDER BY c.priority, c.run_at, c.id) AS nth
    FROM cand AS c LEFT JOIN used AS u ON u.kind = c.kind AND u.gkey = c.gkey
),
free AS (
    SELECT k.kind, k.gkey, g.s AS slot,
           row_number() OVER (PARTITION BY k.kind, k.gkey ORDER BY g.s) AS nth
    FROM (SELECT DISTINCT kind, gkey, conc FROM ranked
          WHERE conc IS NOT NULL AND nth <= room) AS k
    CROSS JOIN LATERAL generate_series(1, k.conc) AS g(s)
    LEFT JOIN awa_limit_lease AS l
        ON l.kind = k.kind AND l.key = {_lease_key("k.gkey")} AND l.slot = g.s
    WHERE l.id IS NULL OR NOT {_LEASE_HELD.format(l="l")}
),
fits AS MATERIALIZED (
    SELECT r.id, r.kind, r.gkey, f.slot, r.run_lease + 1 AS run_lease, r.conc
    FROM ranked AS r
    LEFT JOIN free AS f ON f.kind = r.kind AND f.gkey = r.gkey AND f.nth = r.nth
    WHERE r.conc IS NULL OR (r.nth <= r.room AND f.slot IS NOT NULL)
    ORDER BY r.priority, r.run_at, r.id
    LIMIT %(limit)s
),
leased AS (
    INSERT INTO awa_limit_lease AS l (kind, key, slot, job_id, run_lease, taken_at)
    SELECT f.kind, {_lease_key("f.gkey")}, f.slot, f.id, f.run_lease, now() FROM fits AS f
    WHERE f.conc IS NOT NULL
    ORDER BY 1, 2, 3
    ON CONFLICT (kind, key, slot) DO UPDATE
    SET job_id = excluded.job_id, run_lease = excluded.run_lease, taken_at = excluded.taken_at,
        held_until = NULL
    WHERE NOT {_LEASE_HELD.format(l="l")}
    RETURNING l.job_id
)
UPDATE ONLY awa_job AS j{_CLAIM_SET}
WHERE j.id = ANY(ARRAY(SELECT id FROM fits WHERE conc IS NULL
                       UNION ALL SELECT job_id FROM leased))
RETURNING {J_JOB_COLUMNS}
"""

# -- FREE_STALE_LEASES --
# Maintenance: delete up to %(limit)s leases that no running attempt holds
# (left by a write that took its attempt out of running without releasing
# it, or skipped by a release because a claimer held it locked). Rows another
# session holds are skipped. A small table, read whole; primary key lookups.
FREE_STALE_LEASES = f"""
DELETE FROM awa_limit_lease WHERE id IN (
    SELECT l.id FROM awa_limit_lease AS l
    WHERE NOT {_LEASE_HELD.format(l="l")}
    LIMIT %(limit)s
    FOR UPDATE OF l SKIP LOCKED
)
"""

# ---- Parked sequence members ----
# A sequence member whose earlier member is unfinished cannot start, yet each
# claim of its queue would pass over it again (a probe of
# awa_job_sequence_idx per member: a 2,000-member sequence costs every claim
# 2,000 probes). So such a member is *parked*: it stays available (SPEC 12),
# its run_at moves to PARKED_RUN_AT and the real one is kept in
# metadata["awa_sequence_run_at"]. Every claim's index condition
# (run_at <= now() on awa_job_claim_idx) then drops it from the index tuple,
# without a heap visit or a probe. Parking is only ever a shortcut: the claims
# still judge with _sequence_free, so a member parked or restored at the wrong
# moment could start late, never out of turn.
PARKED_RUN_AT = "'9999-12-31 00:00:00+00'::timestamptz"
SEQUENCE_RUN_AT_KEY = "awa_sequence_run_at"
# What restoring a parked row j sets: its run_at back, the marker gone.
_UNPARK_SET = f"""
SET run_at = (j.metadata ->> '{SEQUENCE_RUN_AT_KEY}')::timestamptz,
    metadata = j.metadata - '{SEQUENCE_RUN_AT_KEY}'"""

# -- CLAIM_SEQUENCED --
# CLAIM for a queue that holds sequence members (its kinds declare sequence=,
# or its claims have met members): the same candidates, order, locks and new
# attempts, and the members passed over because an earlier member is
# unfinished are parked in the same statement. %(scan)s bounds the candidates
# read (the free ones are claimed up to %(limit)s, the others parked).
# The race it must not lose: a member parked after its predecessor's finalize
# looked for a parked member to restore would wait for ever. So a member is
# parked only while this statement holds an unfinished earlier member of its
# key locked: one it is claiming itself (FOR UPDATE, in picked), or else the
# first unfinished one, FOR SHARE (SKIP LOCKED: a row being finalized is
# skipped, and one finalized since this statement's snapshot fails the recheck
# of its state). That member's finalize cannot commit before this statement
# does, and its HAND_OFF, a later statement, then sees the parked member. The
# member itself is locked SKIP LOCKED too (another claimer may be taking it).
# Index: awa_job_claim_idx (parked rows fail its run_at condition in the index
# tuple), awa_job_sequence_idx for the probes and the predecessor.
CLAIM_SEQUENCED = f"""
WITH cand AS MATERIALIZED (
    SELECT c.id, {_sequence_free("c")} AS free
    FROM ONLY awa_job AS c
    WHERE state = 'available' AND queue = %(queue)s AND run_at <= now()
      AND NOT EXISTS (SELECT 1 FROM awa_queue WHERE name = %(queue)s AND paused)
    ORDER BY priority, run_at, id
    LIMIT %(scan)s
),
picked AS (
    SELECT c.id, c.metadata ->> 'awa_sequence' AS seq FROM ONLY awa_job AS c
    WHERE c.id = ANY(ARRAY(SELECT id FROM cand WHERE free)) AND c.state = 'available'
    ORDER BY c.priority, c.run_at, c.id
    LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
),
parked AS (
    UPDATE ONLY awa_job AS j
    SET run_at = {PARKED_RUN_AT},
        -- a member made due again by hand while parked keeps the run_at it had
        metadata = CASE WHEN j.metadata ? '{SEQUENCE_RUN_AT_KEY}' THEN j.metadata
                        ELSE j.metadata || jsonb_build_object('{SEQUENCE_RUN_AT_KEY}', j.run_at)
                   END
    FROM (
        SELECT m.id FROM ONLY awa_job AS m
        WHERE m.id = ANY(ARRAY(SELECT id FROM cand WHERE NOT free))
          AND m.state = 'available'
          AND (EXISTS (
                  SELECT 1 FROM picked AS p
                  WHERE p.seq = (m.metadata ->> 'awa_sequence') AND p.id < m.id)
               OR EXISTS (
                  SELECT 1 FROM (
                      SELECT s.id FROM ONLY awa_job AS s
                      WHERE s.metadata ? 'awa_sequence'
                        AND (s.metadata ->> 'awa_sequence') = (m.metadata ->> 'awa_sequence')
                        AND s.id < m.id AND s.state NOT IN {_FINAL}
                      ORDER BY s.id LIMIT 1
                      FOR SHARE OF s SKIP LOCKED) AS before))
        FOR UPDATE OF m SKIP LOCKED
    ) AS w
    WHERE j.id = w.id
    RETURNING j.id
)
UPDATE ONLY awa_job AS j{_CLAIM_SET}
FROM picked
WHERE j.id = picked.id
RETURNING {J_JOB_COLUMNS}
"""

# -- HAND_OFF --
# In the transaction that finishes sequence members (finalize): restore the
# first unfinished member of each of those keys (%(keys)s) if it is parked,
# so it is claimable the moment this commits. Returns the queues of the
# members restored. Index: awa_job_sequence_idx (one entry per key), the row.
HAND_OFF = f"""
UPDATE ONLY awa_job AS j{_UNPARK_SET}
FROM unnest(%(keys)s::text[]) AS k
{_first_unfinished("k")}
WHERE j.id = h.id AND j.metadata ? '{SEQUENCE_RUN_AT_KEY}'
RETURNING j.queue
"""


# -- HAND_ON --
# HAND_OFF for a worker with free places: in the same transaction, the first
# unfinished member of each key (%(keys)s) is *claimed* for this worker (as
# CLAIM_SEQUENCED claims: running, a new attempt and run_lease, its deadline;
# a parked one gets its run_at back) when the worker reserved a place for it
# (%(places)s, side by side with the keys: the queue of the place, or NULL),
# it is on that queue, available and due, and its queue is not paused. Every
# other such member is restored if parked, as HAND_OFF does. No advisory
# lock: the member is the first unfinished one of its key (enqueue order), and
# its predecessor's outcome is written earlier in this transaction, so it
# starts only after that commits. Its row is locked (FOR UPDATE: the latest
# version is judged) before it is claimed: a claimer that read it cannot be
# starting it (it saw the predecessor unfinished).
# Returns the claimed rows (claimed true) and the restored members' queues (false).
# Index: awa_job_sequence_idx (one entry per key), the rows by primary key
# (joined to nxt, a row a key: a nested loop of primary-key lookups; with
# "= ANY" of nxt's ids the planner guessed ten rows and, on a table without
# statistics, read the whole of awa_job for them).
def _null_row_but(row: str, columns: tuple[str, ...]) -> str:
    """A select list of awa_job's columns, ``row``'s for ``columns`` and NULL (typed)
    for the others: a row of another shape beside whole job rows in one result."""
    return ", ".join(
        f'{row}."{f.column}"' if f.column in columns else f'(NULL::awa_job)."{f.column}"'
        for f in Job._meta.concrete_fields
    )


# The member a nxt row names (take: claim it) claimed or restored: HAND_ON's
# and COMPLETE_HAND_ON's last steps.
_TOOK_RESTORED = f"""
took AS (
    UPDATE ONLY awa_job AS j{_CLAIM_SET},
        run_at = coalesce((j.metadata ->> '{SEQUENCE_RUN_AT_KEY}')::timestamptz, j.run_at),
        metadata = j.metadata - '{SEQUENCE_RUN_AT_KEY}'
    FROM nxt
    WHERE j.id = nxt.id AND nxt.take
    RETURNING {J_JOB_COLUMNS}
),
restored AS (
    UPDATE ONLY awa_job AS j{_UNPARK_SET}
    FROM nxt
    WHERE j.id = nxt.id AND NOT nxt.take AND j.metadata ? '{SEQUENCE_RUN_AT_KEY}'
    RETURNING j.queue
)"""
# Whether the next member j may be claimed into a place on queue {place}
# (NULL: none): on that queue, available, due, its queue not paused, and its
# key's place not kept for a cancelled member's handler (_sequence_held).
_TAKE = f"""{{place}} IS NOT NULL AND j.queue = {{place}} AND j.state = 'available'
           AND coalesce((j.metadata ->> '{SEQUENCE_RUN_AT_KEY}')::timestamptz, j.run_at) <= now()
           AND NOT EXISTS (SELECT 1 FROM awa_queue AS q WHERE q.name = j.queue AND q.paused)
           AND NOT {_sequence_held("j")}"""


# The keys handed on and the places for their next members: two arrays side by
# side, or (_ONE_KEY) one key and its place.
_KEY_ARRAYS = "unnest(%(keys)s::text[], %(places)s::text[]) AS k(key, place)"
_ONE_KEY = "(VALUES (%(key)s::text, %(place)s::text)) AS k(key, place)"


def _next_members(besides: str = "", where: str = "", keys: str = _KEY_ARRAYS) -> str:
    """HAND_ON's and COMPLETE_HAND_ON's ``nxt``: the first unfinished member of each
    key of ``keys`` (%(keys)s), locked, and whether to claim it into its place
    (%(places)s, ``_TAKE``); ``besides`` as ``_first_unfinished``'s, ``where`` on the keys."""
    return f"""nxt AS MATERIALIZED (
    SELECT j.id, {_TAKE.format(place="k.place")} AS take
    FROM {keys}
    {_first_unfinished("k.key", besides=besides)}
    JOIN ONLY awa_job AS j ON j.id = h.id{where}
    FOR UPDATE OF j
)"""


HAND_ON = f"""
WITH {_next_members()},{_TOOK_RESTORED}
SELECT true AS claimed, took.* FROM took
UNION ALL SELECT false, {_null_row_but("r", ("queue",))} FROM restored AS r
"""

# -- RESTORE_PARKED --
# Maintenance, the safety net of HAND_OFF: restore every parked member that is
# the first unfinished one of its key (its predecessor was cancelled through
# the admin, discarded by rescue, deleted...). Reads awa_job_sequence_idx
# whole (the unfinished members of every sequence), in key order.
RESTORE_PARKED = f"""
UPDATE ONLY awa_job AS j{_UNPARK_SET}
FROM (
    SELECT DISTINCT ON (s.metadata ->> 'awa_sequence') s.id,
           s.metadata ? '{SEQUENCE_RUN_AT_KEY}' AS parked
    FROM ONLY awa_job AS s
    WHERE s.metadata ? 'awa_sequence' AND s.state NOT IN {_FINAL}
    ORDER BY s.metadata ->> 'awa_sequence', s.id
) AS h
WHERE j.id = h.id AND h.parked
RETURNING j.queue
"""

# -- CLAIM_INLINE, DUE_INLINE --
# testing.run_jobs: CLAIM across queues (%(queue)s NULL: any) and kinds
# (%(kinds)s NULL: any), on the caller's connection and inside its transaction.
# Paused queues claim nothing. DUE_INLINE says whether such a job is due.
# Every available row is due: a job is inserted available only when it is
# (else scheduled) and promoted only once due. Unlike CLAIM, run_at is not
# compared with now(): inside a test's transaction now() stands still at its
# start, while rows inserted by COPY (follow-ups) take run_at from the column
# default, statement_timestamp(), a little later.
# Index: awa_job_claim_idx when a queue is given; a test's few rows otherwise.
# A sequence's members run one at a time in its order, as in a worker.
_INLINE_DUE = f"""
    SELECT id FROM ONLY awa_job AS c
    WHERE state = 'available'
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
      AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
      AND NOT EXISTS (SELECT 1 FROM awa_queue AS q WHERE q.name = c.queue AND q.paused)
      AND {_sequence_free("c")}"""
CLAIM_INLINE = f"""
WITH picked AS ({_INLINE_DUE}{_CLAIM_PICKED}"""
DUE_INLINE = f"SELECT EXISTS ({_INLINE_DUE})"

# -- PROMOTE_INLINE --
# testing.run_jobs: make the scheduled and retryable jobs of a queue and kinds
# available, as maintenance's PROMOTE_DUE does once they are due; with
# %(all)s, those due later too (run_at moves to now()).
# A job whose key another job holds stays, as in PROMOTE_DUE; of twins, the first is
# promoted.
_INLINE_PROMOTED = f"""{{j}}.state IN {_DELAYED} AND (%(all)s OR {{j}}.run_at <= now())
  AND (%(queue)s::text IS NULL OR {{j}}.queue = %(queue)s::text)
  AND (%(kinds)s::text[] IS NULL OR {{j}}.kind = ANY(%(kinds)s::text[]))"""
PROMOTE_INLINE = f"""
UPDATE ONLY awa_job AS j SET state = 'available',
    run_at = CASE WHEN j.run_at > now() THEN now() ELSE j.run_at END
WHERE {_INLINE_PROMOTED.format(j="j")}
  AND NOT (j.unique_key IS NOT NULL AND coalesce(j.unique_states ? 'available', false)
           AND ({_key_held_elsewhere("j")}
                OR EXISTS (SELECT 1 FROM ONLY awa_job AS o
                           WHERE o.unique_key = j.unique_key AND o.id < j.id
                             AND coalesce(o.unique_states ? 'available', false)
                             AND {_INLINE_PROMOTED.format(j="o")})))
"""

# -- the running guard --
# "This attempt's row is still running", as the statements keyed by attempts
# (id, run_lease) test it: FINALIZE, COMPLETE, HEARTBEAT, STILL_HELD,
# SET_PROGRESS, MARK_STARTED. Their rows are found by primary key; the state
# is only checked on each. Written as a plain ``j.state = 'running'`` it
# matches the predicate of the partial index on running rows
# (awa_job_running_idx), and statistics taken with no
# job running (an ANALYZE of an idle table) value it at one row: the
# planner then read every running row through such an index for each
# batch (hash-joined, or once per attempt in a nested loop), milliseconds to
# seconds a statement at thousands running. ``|| ''`` hides the predicate
# from that match. It is written as "none of the other states" (the CHECK on
# state allows no more), which is the same test: as ``= 'running'`` the
# planner valued it at 0.5% of the rows (its default for an expression), so
# it took a batch's rows for one or two, and compared each with every
# attempt of the batch in a nested loop (1,000 attempts: a million
# comparisons); valued at about all of them, it joins the batch by hash or by
# primary key. Those statements also name their ids in ``j.id = ANY(%(id)s)``,
# beside the join on them, so the planner can look them up in the primary key
# (tests/test_plans.py); for a batch of hundreds in a table of a few
# thousand rows it may read the table instead (a few milliseconds).
_NOT_RUNNING = ", ".join(f"'{state.value}'" for state in JobState if state != JobState.RUNNING)
_RUNNING_ROW = f"j.state || '' NOT IN ({_NOT_RUNNING})"

# The rows a statement keyed by attempts writes are named twice: by a join
# with what an earlier part of it locked, and by their ids (_BATCH_IDS here;
# COMPLETE's forms by the ids they locked, see _complete_writes). A plan made
# while awa_job held a page or two (a fresh table, or a queue just drained:
# the planner counts no fewer rows for it, as it has inheritance children)
# took both sides of that join for a row and read the whole primary key for
# each locked row; the table grew by thousands of rows a second meanwhile,
# and one COMPLETE ran for 30 s (benchmarks/sustained.py). With the ids
# named, no plan reads more of the table than the batch's rows, or the table
# once (tests/test_plans.py). As a filter (``+ 0``), checked against the array
# hashed: as a condition of the index, each lookup of a nested loop sorted the
# whole array again (COMPLETE of 400 attempts: 15.9 ms instead of 10.4).
_BATCH_IDS = "j.id + 0 = ANY(%(id)s::bigint[])"

# -- FINALIZE --
# Record the outcomes of attempts, one row each, in one statement. Guarded by
# (id, run_lease) and state = 'running': a stale attempt (rescued, cancelled,
# or claimed again) changes nothing and is absent from RETURNING. Rows another
# session holds locked (an operator's SELECT ... FOR UPDATE, a heartbeat in
# flight) are skipped, not waited for, so one locked row never holds back the
# batch; they are absent from RETURNING too, and STILL_HELD tells them apart
# from stale ones. Primary key lookups only. Error entries are stamped with
# the database clock. A delay moves run_at; a retryable outcome without one
# (the handler raised) waits the backoff. callback_id is kept only for the
# waiting_external outcome, whose row must carry the callback id the handler
# registered. A completed outcome stores the handler's result.
# A job that others depend on (has_dependents) must have its dependents
# promoted or cancelled in the transaction of its outcome
# (dependencies.py): the statement run on its own, without a transaction,
# leaves such rows out (_STANDALONE) and STILL_HELD tells why, so finalize
# writes them again inside one. The flag is read on the locked row, whose
# latest version carries a flag set by an enqueue that committed meanwhile.
# When the attempt's handler began, on the database clock: the worker sends how
# many seconds ago it began by its own monotonic clock (``started_ago``), so the
# two machines' clocks never meet. statement_timestamp(), not now(): an atomic
# attempt's transaction began before its handler did. Written once per attempt: the row keeps what
# it has when MARK_STARTED stored it already, or when no handler began (NULL
# since the claim).
_STARTED_AT = (
    "CASE WHEN {d}.started_ago IS NULL OR j.attempted_at IS NOT NULL THEN j.attempted_at"
    " ELSE statement_timestamp() - make_interval(secs => {d}.started_ago) END"
)
# The attempts given as two arrays whose rows are still running them.
_RUNNING_ATTEMPTS = f"""
    SELECT j.id FROM ONLY awa_job AS j
    JOIN unnest(%(id)s::bigint[], %(run_lease)s::bigint[]) AS d(id, run_lease)
      ON j.id = d.id AND j.run_lease = d.run_lease
    WHERE j.id = ANY(%(id)s::bigint[]) AND {_RUNNING_ROW}"""


def _held(rows: str) -> str:
    """The CTE ``held``: ``rows`` (a SELECT of ``j.id`` from awa_job AS j), locked,
    skipping those another session holds."""
    return f"""
WITH held AS ({rows}
    FOR UPDATE OF j SKIP LOCKED
)"""


_HELD_ROWS = _held(_RUNNING_ATTEMPTS)


def _finalize(held: str, outcomes: str, ids: str) -> str:
    """FINALIZE's text: the rows ``held`` locks, written with ``outcomes`` (a row
    source ``d``), where ``ids`` names them; ``{dependents}`` left to fill."""
    return f"""{held}
UPDATE ONLY awa_job AS j
SET state = d.state,
    run_at = CASE WHEN d.delay IS NOT NULL THEN now() + make_interval(secs => d.delay)
                  WHEN d.state = 'retryable'
                      THEN now() + make_interval(secs => {_backoff("j.attempt")})
                  ELSE j.run_at END,
    finalized_at = CASE WHEN d.state IN {_FINAL} THEN statement_timestamp() END,
    errors = {_errors_plus("j.", "d.error", "coalesce(d.traceback, '')")},
    snoozed = d.snoozed,
    attempt = CASE WHEN d.reset_attempts THEN 0 ELSE j.attempt END,
    progress = coalesce(d.progress, j.progress),
    attempted_at = {_STARTED_AT.format(d="d")},
    heartbeat_at = CASE WHEN d.state = 'running' THEN j.heartbeat_at END,
    deadline_at = NULL,
    callback_id = CASE WHEN d.state = 'waiting_external' THEN j.callback_id END,
    callback_timeout_at = CASE WHEN d.state = 'waiting_external' THEN j.callback_timeout_at END,
    result = CASE WHEN d.state = 'completed' THEN d.result ELSE j.result END
FROM {outcomes}
     AS d(id, run_lease, state, delay, error, traceback, snoozed, reset_attempts, progress,
          started_ago, result)
WHERE j.id = d.id AND j.id IN (SELECT id FROM held) AND {ids}
  AND j.run_lease = d.run_lease AND {_RUNNING_ROW}{{dependents}}
"""


_FINALIZE = _finalize(
    _HELD_ROWS,
    """unnest(%(id)s::bigint[], %(run_lease)s::bigint[], %(state)s::text[],
            %(delay)s::float8[], %(error)s::text[], %(traceback)s::text[],
            %(snoozed)s::bool[], %(reset_attempts)s::bool[], %(progress)s::jsonb[],
            %(started_ago)s::float8[], %(result)s::jsonb[])""",
    _BATCH_IDS,
)
FINALIZE = _FINALIZE.format(dependents="") + "RETURNING j.id, j.has_dependents"

# -- COMPLETE --
# FINALIZE for the common batch, where every attempt completed and stores no
# progress: the same guard, the same skipped locks and the same columns
# written, from three arrays (id, run_lease, started_ago). They come as array
# literals (text) that the server parses, which costs far less than psycopg
# dumping a list element by element.
# A completed row is written once, straight into awa_job_done_current, the
# current segment of awa_job_done (deleted from awa_job, inserted there with
# its outcome, in one statement), rather than updated in awa_job and then
# moved by ARCHIVE_FINISHED: one heap tuple and its index entries fewer per
# job, and no archive pass over it; it leaves with its segment, dropped whole
# (no DELETE of its own, see *Finished segments*). Columns go by
# position (_DONE_ROW follows the model). A row that holds its unique key
# (unique_states includes 'completed') is updated in place instead, as
# ARCHIVE_FINISHED leaves it: awa_job_unique_idx is on awa_job alone.
# The guard's recheck of state and run_lease is the locked row's (held):
# the outcome's DELETE and UPDATE join held by primary key, where a check of
# state = 'running' there would let the planner scan every running row
# through a partial index for each row of the batch.
_COMPLETED_SET = {
    "state": "'completed'",
    "finalized_at": "statement_timestamp()",
    "snoozed": "false",
    "attempted_at": _STARTED_AT.format(d="held"),
    "heartbeat_at": "NULL::timestamptz",
    "deadline_at": "NULL::timestamptz",
    "callback_id": "NULL::uuid",
    "callback_timeout_at": "NULL::timestamptz",
}
_DONE_ROW = ", ".join(
    f'{_COMPLETED_SET.get(f.attname, f"j.{f.attname}")} AS "{f.attname}"'
    for f in Job._meta.concrete_fields
)
# The attempts written, locked: three arrays side by side, or (_ONE_ATTEMPT)
# one attempt's id, run_lease and started_ago, compared by primary key. The
# arrays' rows are looked up one by one (LATERAL, which a locking clause keeps
# from being flattened into a join): joined with the table, a batch of
# hundreds was hashed against a read of all of it, which the planner prices
# below as many lookups (400 attempts in a table of 20,000: 5 of COMPLETE's
# 10 ms). The lookup is a primary key scan in any table of more than a few
# pages, whatever its statistics say (a read of the whole table costs its pages).
_KEEPS_KEY = (
    "j.unique_key IS NOT NULL AND coalesce(j.unique_states ? 'completed', false) AS keeps_key"
)
_ATTEMPT_ARRAYS = f"""SELECT j.id, d.started_ago, j.keeps_key
    FROM unnest(%(id)s::bigint[], %(run_lease)s::bigint[], %(started_ago)s::float8[])
         AS d(id, run_lease, started_ago)
    CROSS JOIN LATERAL (
        SELECT j.id, {_KEEPS_KEY}
        FROM ONLY awa_job AS j
        WHERE j.id = d.id AND j.run_lease = d.run_lease AND {_RUNNING_ROW}
        FOR UPDATE OF j SKIP LOCKED
    ) AS j"""
# One attempt's row, by %(id)s and %(run_lease)s, still running it.
_ONE_RUNNING = f"j.id = %(id)s::bigint AND j.run_lease = %(run_lease)s::bigint AND {_RUNNING_ROW}"
_ONE_ATTEMPT = f"""SELECT j.id, %(started_ago)s::float8 AS started_ago, {_KEEPS_KEY}
    FROM ONLY awa_job AS j
    WHERE {_ONE_RUNNING}
    FOR UPDATE OF j SKIP LOCKED"""


# The completed rows a completion under COMPLETED_RETENTION = 0 still writes into
# awa_job_done_current (FORGETTING): a job others depend on, whose state the
# settling of its dependents looks up (now, or when another of their
# dependencies finishes), and a workflow's member, by whose states the
# workflow finishes.
_STILL_READ = "gone.has_dependents OR gone.workflow_id IS NOT NULL"


def _complete_writes(attempts: str, *, forget: bool = False) -> str:
    """COMPLETE's CTEs (held, kept, gone, moved) for ``attempts`` (``_ATTEMPT_ARRAYS``
    or ``_ONE_ATTEMPT``); ``{dependents}``, ``{returning_j}`` and ``{returning}`` left
    to fill. The rows kept or moved are found by primary key, = ANY of the ids held:
    joined with ``held`` only, the planner took a batch of hundreds for a hash
    against a read of the whole table, or, planned while the table looked empty,
    read its whole primary key once per row held. With ``forget``, the form
    FORGETTING names: only the deleted rows something still reads are moved."""
    if forget:
        moved = f"""moved AS (
    SELECT {{returning}} FROM gone
),
stayed AS (
    INSERT INTO awa_job_done_current ({JOB_COLUMNS})
    SELECT * FROM gone WHERE {_STILL_READ}
)"""
    else:
        moved = f"""moved AS (
    INSERT INTO awa_job_done_current ({JOB_COLUMNS}) SELECT * FROM gone
    RETURNING {{returning}}
)"""
    return f"""
WITH held AS (
    {attempts}
),
kept AS (
    UPDATE ONLY awa_job AS j
    SET {", ".join(f"{column} = {value}" for column, value in _COMPLETED_SET.items())}
    FROM held
    WHERE j.id = ANY(ARRAY(SELECT id FROM held WHERE keeps_key)) AND j.id = held.id
      AND held.keeps_key{{dependents}}
    RETURNING {{returning_j}}
),
gone AS (
    DELETE FROM ONLY awa_job AS j
    USING held
    WHERE j.id = ANY(ARRAY(SELECT id FROM held WHERE NOT keeps_key)) AND j.id = held.id
      AND NOT held.keeps_key{{dependents}}
    RETURNING {_DONE_ROW}
),
{moved}"""


_COMPLETE_TAIL = "\nSELECT * FROM kept UNION ALL SELECT * FROM moved\n"
_COMPLETE = _complete_writes(_ATTEMPT_ARRAYS) + _COMPLETE_TAIL
_STANDALONE = " AND NOT j.has_dependents"
_ID_FLAG = {"returning_j": "j.id, j.has_dependents", "returning": "id, has_dependents"}
_ALL_COLUMNS = {"returning_j": J_JOB_COLUMNS, "returning": JOB_COLUMNS}
COMPLETE = _COMPLETE.format(dependents="", **_ID_FLAG)
COMPLETE_RETURNING_ROWS = _COMPLETE.format(dependents="", **_ALL_COLUMNS)
FINALIZE_RETURNING_ROWS = _FINALIZE.format(dependents="") + f"RETURNING {J_JOB_COLUMNS}"
# The same on their own (autocommit): jobs with dependents left out.
COMPLETE_STANDALONE = _COMPLETE.format(dependents=_STANDALONE, **_ID_FLAG)
FINALIZE_STANDALONE = _FINALIZE.format(dependents=_STANDALONE) + "RETURNING j.id, j.has_dependents"

# -- FINALIZE_ONE, FINALIZE_ONE_STANDALONE, FINALIZE_ONE_RETURNING_ROWS --
# FINALIZE and its forms for one outcome, its values as scalars (the names of
# AttemptResult.params()): an atomic=True handler's retry, failure or result,
# a batch of one. Prepared (sql.PREPARED), as COMPLETE_ONE, for the same reasons
# (for one row, 0.27 ms of planning against 0.15 ms of execution): the row by
# primary key, whatever the parameters.
_FINALIZE_ONE = _finalize(
    _held(f"""
    SELECT j.id FROM ONLY awa_job AS j
    WHERE {_ONE_RUNNING}"""),
    """(SELECT %(id)s::bigint, %(run_lease)s::bigint, %(state)s::text, %(delay)s::float8,
             %(error)s::text, %(traceback)s::text, %(snoozed)s::bool, %(reset_attempts)s::bool,
             %(progress)s::jsonb, %(started_ago)s::float8, %(result)s::jsonb)""",
    "j.id = %(id)s::bigint",
)
FINALIZE_ONE = _FINALIZE_ONE.format(dependents="") + "RETURNING j.id, j.has_dependents"
FINALIZE_ONE_STANDALONE = (
    _FINALIZE_ONE.format(dependents=_STANDALONE) + "RETURNING j.id, j.has_dependents"
)
FINALIZE_ONE_RETURNING_ROWS = _FINALIZE_ONE.format(dependents="") + f"RETURNING {J_JOB_COLUMNS}"

# -- COMPLETE_ONE, COMPLETE_ONE_STANDALONE, COMPLETE_ONE_RETURNING_ROWS --
# COMPLETE, COMPLETE_STANDALONE and COMPLETE_RETURNING_ROWS for one completion
# (%(id)s, %(run_lease)s, %(started_ago)s as scalars): an atomic=True handler's
# outcome, written in its own transaction, and a completer's batch of one, which
# is every batch of a worker whose jobs finish one at a time. The same writes,
# the same result. Prepared (sql.PREPARED): parsing and planning the statement
# took about three times as long as running it for one row (0.27 ms of
# planning against 0.13 ms of execution). With scalars only, its plan for any
# parameters is its plan for each: the row by primary key, kept or moved.
_COMPLETE_ONE = _complete_writes(_ONE_ATTEMPT) + _COMPLETE_TAIL
COMPLETE_ONE = _COMPLETE_ONE.format(dependents="", **_ID_FLAG)
COMPLETE_ONE_STANDALONE = _COMPLETE_ONE.format(dependents=_STANDALONE, **_ID_FLAG)
COMPLETE_ONE_RETURNING_ROWS = _COMPLETE_ONE.format(dependents="", **_ALL_COLUMNS)


# -- COMPLETE_HAND_ON --
# COMPLETE_STANDALONE and HAND_ON in one statement (autocommit, one round
# trip): for a batch of completions holding sequence members, the outcomes
# are written and each of their sequences handed on to its next member,
# claimed into a place this worker reserved or restored (%(keys)s and
# %(places)s as HAND_ON's; a key whose member was left out is skipped), in one
# transaction. Its snapshot still
# sees the members it completes as running, so the next member of a key is
# its first unfinished one but those (the members before them are finished:
# each was running). The rows with dependents are left out, as standalone.
# Returns the completed rows' (id, has_dependents) in the columns of id and
# has_dependents, the others NULL (claimed false), and the claimed rows
# (claimed true). Index: as COMPLETE and HAND_ON.
def _complete_hand_on(attempts: str, keys: str, besides: str, *, forget: bool = False) -> str:
    """COMPLETE_HAND_ON for ``attempts`` (as ``_complete_writes``, ``forget`` too) and
    ``keys`` (as ``_next_members``); ``besides`` leaves the members it completes out
    of ``nxt``."""
    writes = _complete_writes(attempts, forget=forget).format(
        dependents=_STANDALONE,
        returning_j="j.id, j.has_dependents, j.metadata ->> 'awa_sequence' AS seq",
        returning="id, has_dependents, metadata ->> 'awa_sequence'",
    )
    members = _next_members(
        besides=besides, where="\n    WHERE k.key = ANY(ARRAY(SELECT seq FROM done))", keys=keys
    )
    return f"""{writes},
done AS (SELECT * FROM kept UNION ALL SELECT * FROM moved),
{members},{_TOOK_RESTORED}
SELECT true AS claimed, took.* FROM took
UNION ALL SELECT false, {_null_row_but("d", ("id", "has_dependents"))} FROM done AS d
"""


_BESIDES_DONE = " AND s.id <> ALL(ARRAY(SELECT id FROM done))"
COMPLETE_HAND_ON = _complete_hand_on(_ATTEMPT_ARRAYS, _KEY_ARRAYS, _BESIDES_DONE)

# -- COMPLETE_HAND_ON_ONE --
# COMPLETE_HAND_ON for one completion (%(id)s, %(run_lease)s, %(started_ago)s)
# and its sequence (%(key)s, %(place)s: the queue of the place reserved, or
# NULL): a saturated sequence's every member. The same writes, the same
# result. Prepared (sql.PREPARED): parsing and planning the statement cost
# more than running it. With scalars only, its plan made for any parameters
# is the one made for each (no array whose length the planner must guess):
# every row by primary key, the next member by awa_job_sequence_idx. (On a
# table of a page or two without statistics that plan reads awa_job whole, as
# any plan would; the statistics autovacuum then gathers make PostgreSQL plan
# it again.)
_BESIDES_ONE = " AND s.id <> %(id)s::bigint"
COMPLETE_HAND_ON_ONE = _complete_hand_on(_ONE_ATTEMPT, _ONE_KEY, _BESIDES_ONE)


# -- FORGETTING --
# COMPLETE's forms (COMPLETE, COMPLETE_ONE, COMPLETE_HAND_ON and their
# variants) as they run when AWA["COMPLETED_RETENTION"] is 0: completed jobs
# are not kept. The completion deletes the row from awa_job and writes it
# nowhere, unless something still reads it (_STILL_READ): those move into
# awa_job_done_current as before, and leave with it (Maintenance.rotate_finished:
# once its oldest row is MIN_SEGMENT_AGE old).
# A row that holds its unique key is completed in place as before. Each
# returns what its keeping form returns, read from the deleted rows. Not the
# _RETURNING_ROWS forms: they write jobs with follow-ups, which may name their
# trigger in after= (inserted later in the same transaction, they would find
# it gone), and jobs whose outcome a signal receiver is given; those are kept
# until their segment goes too. Per job, no heap tuple and no four index
# entries in awa_job_done_current (benchmarks/statement_cost.py --forget).
def _forgetting() -> dict[str, str]:
    arrays = _complete_writes(_ATTEMPT_ARRAYS, forget=True) + _COMPLETE_TAIL
    one = _complete_writes(_ONE_ATTEMPT, forget=True) + _COMPLETE_TAIL
    return {
        COMPLETE: arrays.format(dependents="", **_ID_FLAG),
        COMPLETE_STANDALONE: arrays.format(dependents=_STANDALONE, **_ID_FLAG),
        COMPLETE_ONE: one.format(dependents="", **_ID_FLAG),
        COMPLETE_ONE_STANDALONE: one.format(dependents=_STANDALONE, **_ID_FLAG),
        COMPLETE_HAND_ON: _complete_hand_on(
            _ATTEMPT_ARRAYS, _KEY_ARRAYS, _BESIDES_DONE, forget=True
        ),
        COMPLETE_HAND_ON_ONE: _complete_hand_on(_ONE_ATTEMPT, _ONE_KEY, _BESIDES_ONE, forget=True),
    }


FORGETTING = _forgetting()


# -- RELEASING --
# The forms of FINALIZE and COMPLETE (and their variants) for a batch holding
# attempts of kinds with an awa.Limit(concurrency=...): the same statement, and
# in it, the deletion of each written attempt's lease (awa_limit_lease, by
# job_id and run_lease: awa_limit_lease_job_idx), so a key frees in the
# transaction that takes its attempt out of running. A lease a claimer holds
# locked at that instant (its ON CONFLICT met it) is skipped, never waited
# for: it is stale once this commits, and the next claim of its slot takes
# it over. Batches without such kinds run the plain forms and pay nothing.
# The exact forms (an attempt's own outcome, its handler done) also delete a
# lease a cancel or rescue kept for the attempt (held_until set, see below),
# when the row was no longer the attempt's to write. An attempt they do write
# while its lease is held keeps it: its handler, past its timeout, was
# abandoned and still runs (HOLD_LEASES); its worker frees it when it returns.
# So does one they leave out while its row is still running (another session
# held it locked: the outcome is written again later, its handler may run).
#
# A cancel or a rescue (CANCEL_JOBS, RESCUE) of an attempt whose handler may
# still run in a live worker (the row is running and its heartbeat is fresh,
# within %(stale_after)s) keeps its lease instead: held_until set STALE_AFTER
# ahead, so the key's place stays taken while a handler that ignores
# is_cancelled() goes on. The worker renews it (RENEW_HELD_LEASES) until the
# handler returns, then deletes it (RELEASE_HELD_LEASES, or the outcome's own
# write); a worker that died renews nothing and the place frees once
# held_until passes, as its attempts' would be rescued.
def _released(ids: str, *, exact: bool, kept: str | None = None) -> str:
    """The CTE deleting the leases of the jobs ``ids`` (a subquery) writes; with
    ``exact``, only those of the attempts named by %(id)s and %(run_lease)s. With
    ``kept`` (a subquery of job ids), those jobs' leases are kept, held_until set."""
    if exact:
        match = """JOIN unnest(%(id)s::bigint[], %(run_lease)s::bigint[]) AS a(id, run_lease)
          ON l.job_id = a.id AND l.run_lease = a.run_lease
        WHERE (a.id IN ({ids}) AND l.held_until IS NULL)
           OR (a.id NOT IN ({ids}) AND l.held_until IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM ONLY awa_job AS x WHERE x.id = a.id
                 AND x.run_lease = a.run_lease AND x.state = 'running'))"""
    else:
        match = "WHERE l.job_id IN ({ids})"
    if kept is not None:
        match += f" AND l.job_id NOT IN ({kept})"
    released = f"""released AS (
    DELETE FROM awa_limit_lease WHERE id IN (
        SELECT l.id FROM awa_limit_lease AS l
        {match.format(ids=ids)}
        FOR UPDATE OF l SKIP LOCKED)
)"""
    if kept is None:
        return released
    return f"""{released},
held AS (
    UPDATE awa_limit_lease AS l
    SET held_until = now() + make_interval(secs => %(stale_after)s)
    WHERE l.job_id IN ({ids}) AND l.job_id IN ({kept})
)"""


_UPDATE_HEAD = "\nUPDATE ONLY awa_job AS j"


def _releasing(statement: str, *, exact: bool = True, kept: str | None = None) -> str:
    """``statement`` (a WITH ... UPDATE ONLY awa_job AS j ... RETURNING, or a
    _COMPLETE form) with the leases of the attempts it writes released (``kept``:
    see _released)."""
    if statement.endswith(_COMPLETE_TAIL):
        ids = "SELECT id FROM kept UNION ALL SELECT id FROM gone"
        head = statement[: -len(_COMPLETE_TAIL)]
        return f"{head},\n{_released(ids, exact=exact)}{_COMPLETE_TAIL}"
    at = statement.rindex(_UPDATE_HEAD)
    if not statement.lstrip().startswith("WITH"):  # pragma: no cover - by construction
        raise RuntimeError("_releasing: not a WITH ... UPDATE statement")
    head, tail = statement[:at], statement[at:]
    released = _released("SELECT id FROM w", exact=exact, kept=kept)
    return f"{head},\nw AS ({tail}\n),\n{released}\nSELECT * FROM w\n"


RELEASING = {
    statement: _releasing(statement)
    for statement in (
        FINALIZE,
        FINALIZE_STANDALONE,
        FINALIZE_RETURNING_ROWS,
        COMPLETE,
        COMPLETE_STANDALONE,
        COMPLETE_RETURNING_ROWS,
        FORGETTING[COMPLETE],
        FORGETTING[COMPLETE_STANDALONE],
    )
}

# -- STILL_HELD --
# Of attempts a FINALIZE or COMPLETE left out, those whose row is still
# running this attempt: another session held it locked, and the outcome is
# written again later; or, for the _STANDALONE forms, the job has dependents
# and its outcome is written again at once inside a transaction. The others
# were stale. No lock taken; primary key lookups.
STILL_HELD = _RUNNING_ATTEMPTS.replace("SELECT j.id", "SELECT j.id, j.has_dependents", 1)

# -- HEARTBEAT --
# Mark this worker's running attempts alive and report which are still held:
# one missing was cancelled, rescued or otherwise lost, and its handler is
# told through JobContext.is_cancelled(). Only rows whose heartbeat is older
# than %(fresh)s seconds are written: a row claimed (or beaten) since needs
# none yet, and under a burst nearly every attempt a worker holds was claimed
# moments ago, so the statement locks and rewrites (a non-HOT update:
# heartbeat_at is indexed) a few long-running rows, not thousands that the
# completer is about to finalize. Rows locked by a concurrent write (the
# completer finalizing them) are skipped, not waited for, so a heartbeat never
# deadlocks with a batched finalize; they still count as held when the
# statement's snapshot shows them running. Primary key lookups.
HEARTBEAT = f"""
WITH held AS ({_RUNNING_ATTEMPTS}
),
beat AS (
    UPDATE ONLY awa_job AS j SET heartbeat_at = now()
    FROM (SELECT id FROM ONLY awa_job AS j WHERE id IN (SELECT id FROM held) AND {_BATCH_IDS}
            AND heartbeat_at < now() - make_interval(secs => %(fresh)s)
          ORDER BY id FOR UPDATE SKIP LOCKED) AS l
    WHERE j.id = l.id AND {_BATCH_IDS}
    RETURNING j.id
)
SELECT id FROM held
"""

# -- HOLD_LEASES --
# Attempts still running whose handler thread the worker abandoned (past its
# timeout, it did not return): their outcome is written now, but their key's
# place stays taken while the handler runs. Their leases get held_until
# %(stale_after)s ahead, as a cancel's (_released), before the outcome is
# written, which then keeps them; renewed (RENEW_HELD_LEASES) until the
# handler returns. Primary key lookups (awa_limit_lease_job_idx).
HOLD_LEASES = """
UPDATE awa_limit_lease AS l SET held_until = now() + make_interval(secs => %(stale_after)s)
FROM unnest(%(id)s::bigint[], %(run_lease)s::bigint[]) AS a(id, run_lease)
WHERE l.job_id = a.id AND l.run_lease = a.run_lease
"""

# -- RENEW_HELD_LEASES --
# A worker's lost attempts (cancelled, rescued, abandoned) of kinds with
# awa.Limit(concurrency=...) whose handler still runs: the leases kept for them
# (held_until set, see _released and HOLD_LEASES) stay held for
# %(stale_after)s more; the others' are left as they are.
RENEW_HELD_LEASES = HOLD_LEASES.rstrip() + " AND l.held_until IS NOT NULL\n"

# -- RELEASE_HELD_LEASES --
# The handlers of these lost attempts returned (or never began), or their
# worker is exiting, which ends them: the leases kept for them go. One the
# claim holds locked at that instant is waited for. Returns the sequence keys
# whose place went (SEQUENCE_HOLD_KIND): their next members' claimers are woken.
RELEASE_HELD_LEASES = f"""
DELETE FROM awa_limit_lease AS l
USING unnest(%(id)s::bigint[], %(run_lease)s::bigint[]) AS a(id, run_lease)
WHERE l.job_id = a.id AND l.run_lease = a.run_lease AND l.held_until IS NOT NULL
RETURNING CASE WHEN l.kind = '{SEQUENCE_HOLD_KIND}' THEN l.key END
"""

# -- SET_PROGRESS --
# Store the progress reported by running attempts, guarded by (id, run_lease).
SET_PROGRESS = f"""
UPDATE ONLY awa_job AS j SET progress = d.progress
FROM unnest(%(id)s::bigint[], %(run_lease)s::bigint[], %(progress)s::jsonb[])
     AS d(id, run_lease, progress)
WHERE j.id = d.id AND j.id = ANY(%(id)s::bigint[]) AND j.run_lease = d.run_lease
  AND {_RUNNING_ROW}
"""

# -- MARK_STARTED --
# Record when the handlers of attempts still running began (attempted_at, NULL
# from the claim until then), and move each deadline on by how long its job
# waited in the worker's inbox after the claim: the deadline counts the
# handler's time. Guarded by (id, run_lease), running, and attempted_at still
# NULL, so it writes each attempt once. Rows another session holds locked (the
# completer finalizing them) are skipped, not waited for, as HEARTBEAT does;
# RETURNING names those written. Primary key lookups.
MARK_STARTED = f"""
WITH d AS (
    SELECT * FROM unnest(%(id)s::bigint[], %(run_lease)s::bigint[],
                         %(started_ago)s::float8[], %(waited)s::float8[])
         AS d(id, run_lease, started_ago, waited)
),
l AS (
    SELECT j.id FROM ONLY awa_job AS j JOIN d ON j.id = d.id AND j.run_lease = d.run_lease
    WHERE j.id = ANY(%(id)s::bigint[]) AND {_RUNNING_ROW} AND j.attempted_at IS NULL
    ORDER BY j.id FOR UPDATE OF j SKIP LOCKED
)
UPDATE ONLY awa_job AS j
SET attempted_at = statement_timestamp() - make_interval(secs => d.started_ago),
    deadline_at = j.deadline_at + make_interval(secs => d.waited)
FROM d, l
WHERE j.id = d.id AND j.id = l.id AND {_BATCH_IDS}
RETURNING j.id
"""

# -- LOCAL_LOCK_TIMEOUT --
# How long this transaction's statements wait for a lock (lock_timeout, e.g. '1s'):
# a callback registered apart from its handler's transaction, which may hold
# the row (execute._register_apart). For the transaction only: behind a pooler in
# transaction mode the session is another client's next.
LOCAL_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(timeout)s, true)"

# -- REGISTER_CALLBACK --
# A running attempt registers the callback id an outside system will answer.
REGISTER_CALLBACK = """
UPDATE ONLY awa_job
SET callback_id = %(callback_id)s,
    callback_timeout_at = now() + make_interval(secs => %(timeout)s)
WHERE id = %(id)s AND run_lease = %(run_lease)s AND state = 'running'
RETURNING id
"""

# -- PROMOTE_DUE --
# Make due scheduled and retryable jobs available, in batches. A job whose key
# is held while available but not while it waits (Unique(states=...) without
# 'scheduled' or 'retryable') stays until no other job holds its key: made
# available meanwhile, it would break the unique index and fail the whole
# statement, every job's, every tick. Of due twins, the first is promoted.
# Index: awa_job_due_idx (run_at) WHERE state IN ('scheduled', 'retryable');
# awa_job_unique_idx for the key's holder.
PROMOTE_DUE = f"""
WITH due AS (
    SELECT id, unique_key, coalesce(unique_states ? 'available', false) AS takes_key
    FROM ONLY awa_job AS j
    WHERE state IN {_DELAYED} AND run_at <= now()
      AND NOT (j.unique_key IS NOT NULL AND coalesce(j.unique_states ? 'available', false)
               AND {_key_held_elsewhere("j")})
    ORDER BY run_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE ONLY awa_job AS j SET state = 'available'
FROM due
WHERE j.id = due.id
  AND NOT (due.takes_key AND EXISTS (SELECT 1 FROM due AS o
                                     WHERE o.takes_key AND o.unique_key = due.unique_key
                                       AND o.id < due.id))
RETURNING j.queue
"""

# -- RESCUE --
# Take back running attempts whose heartbeat is stale or whose deadline
# passed, and waiting_external jobs whose callback timed out. The attempt
# counts: retryable with backoff, or failed when attempts are used up. The
# error entry names the reason. Rows locked with SKIP LOCKED so a worker
# finishing the same job at this instant either wins (row absent) or loses
# (its guarded UPDATE then matches nothing).
# Indexes: awa_job_running_idx (both searches of running rows: they are few),
# awa_job_callback_idx.
# A rescued job's unique key, were it to hold it again: held by another job, or by a
# victim before it that this rescue makes hold it.
_RESCUE_KEY_TAKEN = f"""({_key_held_elsewhere("j")}
                 OR EXISTS (SELECT 1 FROM victims AS o JOIN ONLY awa_job AS h ON h.id = o.id
                            WHERE o.id < j.id AND h.unique_key = j.unique_key))"""
_RESCUE_ERROR = """'rescued: ' || replace(v.reason, '_', ' ') || CASE WHEN locked.held
    THEN ', not retried: another job holds its unique key' ELSE '' END"""
RESCUE = f"""
WITH candidates AS (
    (SELECT id, 'stale_heartbeat' AS reason, 1 AS rank FROM ONLY awa_job
     WHERE state = 'running' AND heartbeat_at < now() - make_interval(secs => %(stale_after)s)
     LIMIT %(limit)s)
    UNION ALL
    (SELECT id, 'deadline_exceeded', 2 FROM ONLY awa_job
     WHERE state = 'running' AND deadline_at < now()
     LIMIT %(limit)s)
    UNION ALL
    (SELECT id, 'callback_timeout', 3 FROM ONLY awa_job
     WHERE state = 'waiting_external' AND callback_timeout_at < now()
     LIMIT %(limit)s)
),
victims AS (
    SELECT DISTINCT ON (id) id, reason FROM candidates ORDER BY id, rank
),
locked AS (
    -- Re-checked on the locked row version: a heartbeat or finalize that
    -- committed since the scan keeps the job out.
    SELECT j.id, j.state = 'running'
                 AND j.heartbeat_at >= now() - make_interval(secs => %(stale_after)s) AS live,
           -- Its retry would hold its unique key, which another job holds (a twin
           -- enqueued while it waited on a callback, a state its key is not held
           -- in), or a victim before it would take: it fails instead, since
           -- the conflict would abort the whole rescue, every job's, every tick.
           (j.unique_key IS NOT NULL AND j.attempt < j.max_attempts
            AND j.unique_states ? 'retryable'
            AND {_RESCUE_KEY_TAKEN}) AS held,
           -- Failed, it would hold its key (Unique(states=...) with 'failed'), which
           -- another job holds, or a victim before it would take: it fails without
           -- holding it ('failed' leaves its unique_states), for the same reason.
           (j.unique_key IS NOT NULL AND j.unique_states ? 'failed'
            AND {_RESCUE_KEY_TAKEN}) AS failed_held
    FROM ONLY awa_job AS j
    WHERE j.id IN (SELECT id FROM victims)
      AND ((j.state = 'running'
            AND (j.heartbeat_at < now() - make_interval(secs => %(stale_after)s)
                 OR j.deadline_at < now()))
           OR (j.state = 'waiting_external' AND j.callback_timeout_at < now()))
    FOR UPDATE SKIP LOCKED
)
UPDATE ONLY awa_job AS j
SET state = CASE WHEN j.attempt >= j.max_attempts OR locked.held THEN 'failed' ELSE 'retryable' END,
    finalized_at = CASE WHEN j.attempt >= j.max_attempts OR locked.held THEN now() END,
    run_at = CASE WHEN j.attempt >= j.max_attempts OR locked.held THEN j.run_at
             ELSE now() + make_interval(secs => {_backoff("j.attempt")}) END,
    unique_states = CASE WHEN (j.attempt >= j.max_attempts OR locked.held) AND locked.failed_held
                    THEN j.unique_states - 'failed' ELSE j.unique_states END,
    errors = {_errors_plus("j.", _RESCUE_ERROR)},
    {_ATTEMPT_CLEARED}
FROM locked JOIN victims AS v ON v.id = locked.id
WHERE j.id = locked.id
RETURNING v.reason, {J_JOB_COLUMNS}
"""
# Past its deadline with a fresh heartbeat, an attempt's handler still runs in
# its worker: its key's lease is kept (_released).
RESCUE = _releasing(RESCUE, exact=False, kept="SELECT id FROM locked WHERE live")

# -- POSTPONE_PENDING --
# A pending follow-up's insert failed again: count the try, keep the error and
# retry it after the backoff of its try number (at most 12: about an hour
# apart), from %(now)s (maintenance's injected now) or the database clock.
# Primary key lookup.
POSTPONE_PENDING = f"""
UPDATE awa_pending_followup
SET attempts = attempts + 1,
    next_attempt_at = coalesce(%(now)s::timestamptz, now())
        + make_interval(secs => {_backoff("least(attempts + 1, 12)")}),
    last_error = %(error)s
WHERE id = %(id)s
RETURNING attempts, outcome, job_id,
          extract(epoch FROM next_attempt_at - coalesce(%(now)s::timestamptz, now()))
"""

# -- DATABASE_NOW --
# The database clock, for maintenance duties that judge due times in Python
# (periodic fires) when no now is injected.
DATABASE_NOW = "SELECT now()"

# -- AGE_PRIORITIES --
# Priority aging: an available job moves up one priority level per aging
# interval it has waited past its run_at, so a flood of high-priority jobs
# cannot starve it. The original priority is kept in
# metadata["awa_original_priority"]; run_at is left alone, so the job keeps
# its place among jobs of its new priority. Only rows whose level changes are
# written. Uses awa_job_claim_idx's state predicate. A kept original that is
# not a priority (a row written around enqueue's checks) counts as absent:
# one odd row must not make the statement fail for all.
_ORIGINAL = """CASE WHEN jsonb_typeof(metadata -> 'awa_original_priority') = 'number' THEN
                 CASE WHEN (metadata ->> 'awa_original_priority')::numeric IN (1, 2, 3, 4)
                      THEN (metadata ->> 'awa_original_priority')::numeric::int END END"""
_AGED = f"""greatest(1, coalesce({_ORIGINAL}, priority)
                  - floor(extract(epoch FROM now() - run_at) / %(interval)s)::int)"""
AGE_PRIORITIES = f"""
UPDATE ONLY awa_job
SET metadata = CASE WHEN metadata ? 'awa_original_priority' THEN metadata
                    ELSE metadata || jsonb_build_object('awa_original_priority', priority) END,
    priority = {_AGED}
WHERE id IN (
    SELECT id FROM ONLY awa_job
    WHERE state = 'available' AND priority > 1
      AND run_at < now() - make_interval(secs => %(interval)s)
      AND priority > {_AGED}
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
"""

# -- PRUNE_FINISHED --
# Delete finished rows past retention, one batch per call, from awa_job and
# awa_job_done themselves (ONLY: the segments of awa_job_done are dropped
# whole, see *Finished segments*).
# Index: awa_job_finalized_idx and awa_job_done_state_finalized_at_idx
# (state, finalized_at).
# The pruned jobs' own dependency edges go with them (primary key of
# awa_job_dependency); edges naming them as a dependency stay until their
# dependent is pruned, but for the dependents of a pruned completed job: that
# edge goes, as the dependency was met (a requires='completed' dependency whose
# row is gone otherwise counts as deleted before it finished, see
# MEET_BY_DELETION), whatever the dependent's state: a blocked one waits for
# another dependency still, a failed or cancelled one waits for its
# dependencies again once retried.
# Index: the primary key of awa_job_dependency for the pruned jobs' own edges
# (= ANY(ARRAY(...)): with IN (SELECT ...) the planner hashed the pruned ids
# and read all 1,000,000 edges of benchmarks/workflows.py --plans),
# awa_dependency_dependents_idx for their dependents'. Returns how many jobs
# it deleted.
_PRUNE_BATCH = """
    DELETE FROM ONLY {table} WHERE id IN (
        SELECT id FROM ONLY {table}
        WHERE state = ANY(%(states)s::text[])
          AND finalized_at < now() - make_interval(secs => %(retention)s)
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id, state, has_dependents"""
PRUNE_FINISHED = f"""
WITH live AS ({_PRUNE_BATCH.format(table="awa_job")}
),
done AS ({_PRUNE_BATCH.format(table="awa_job_done")}
),
gone AS (SELECT * FROM live UNION ALL SELECT * FROM done),
edges AS (
    DELETE FROM awa_job_dependency WHERE job_id = ANY(ARRAY(SELECT id FROM gone))
),
met AS (
    DELETE FROM awa_job_dependency AS e
    USING gone AS g
    WHERE g.has_dependents AND g.state = 'completed' AND e.depends_on_id = g.id
      AND e.job_id <> ALL(ARRAY(SELECT id FROM gone))
)
SELECT count(*) FROM gone
"""

# ==== Finished segments (migration 0016, Maintenance.rotate_finished) ====
# COMPLETE writes into awa_job_done_current, a child of awa_job_done. The
# maintenance leader renames it once its oldest row is old enough
# (ROTATE_SEGMENT), and drops a renamed one whole once its newest completed
# row is past retention (KEEP_FROM_SEGMENT, SEGMENT_EDGES, then DROP TABLE):
# no DELETE per row, no dead rows. Segment names are made by the engine
# ({segment}: awa_job_done_<UTC timestamp>, quoted), never from input.
CURRENT_SEGMENT = "awa_job_done_current"

# -- CURRENT_SEGMENT_AGE --
# Seconds since the oldest completed row of awa_job_done_current finished
# (NULL: none). Index: its (state, finalized_at), the first entry.
CURRENT_SEGMENT_AGE = """
SELECT extract(epoch FROM now() - min(finalized_at))::float8
FROM ONLY awa_job_done_current WHERE state = 'completed'
"""

# -- ROTATE_SEGMENT --
# Rename awa_job_done_current (an ACCESS EXCLUSIVE lock for a moment: an
# outcome writing into it finishes first, the next waits) and make the new,
# empty one (awa_job_done_segment(), migration 0016). Prepared statements
# naming awa_job_done_current are planned again and write into the new one.
ROTATE_SEGMENT = "ALTER TABLE awa_job_done_current RENAME TO {segment}"
NEW_CURRENT_SEGMENT = "SELECT awa_job_done_segment('awa_job_done_current')"

# -- FINISHED_SEGMENTS --
# The renamed segments, oldest first. A catalog read.
FINISHED_SEGMENTS = """
SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = 'awa_job_done'::regclass AND c.relname <> 'awa_job_done_current'
ORDER BY c.relname
"""

# -- SEGMENT_NEWEST --
# Seconds since a segment's newest completed row finished (NULL: none
# completed). Index: its (state, finalized_at), the last entry.
SEGMENT_NEWEST = """
SELECT extract(epoch FROM now() - max(finalized_at))::float8
FROM ONLY {segment} WHERE state = 'completed'
"""

# -- SEGMENT_ROWS --
# How many rows a segment about to be dropped holds, read before its lock (no
# row enters a renamed segment). A sequential scan, once per segment.
SEGMENT_ROWS = "SELECT count(*) FROM ONLY {segment}"

# -- SEGMENT_LOCK_TIMEOUT --
# How long the rename and the drop of a segment wait for its lock before
# giving up until the next pass: every query that asks for the table meanwhile
# waits behind them.
SEGMENT_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '1s'"

# -- LOCK_SEGMENT --
# Before dropping a segment: no one reads or writes it until the drop commits
# (run with a short lock_timeout: a long read of awa_job holds it off until
# the next pass).
LOCK_SEGMENT = "LOCK TABLE ONLY {segment} IN ACCESS EXCLUSIVE MODE"

# -- KEEP_FROM_SEGMENT --
# The rows of a segment about to be dropped that stay, copied into
# awa_job_done, where pruning deletes them row by row: those others depend on
# (pruning settles their blocked dependents), and any still within their
# state's retention (%(completed)s, %(failed)s seconds). Index: the segment's
# (id) WHERE has_dependents, and its (state, finalized_at).
KEEP_FROM_SEGMENT = """
INSERT INTO awa_job_done
SELECT * FROM ONLY {segment} WHERE has_dependents
UNION ALL
SELECT * FROM ONLY {segment}
WHERE state = 'completed' AND NOT has_dependents
  AND finalized_at >= now() - make_interval(secs => %(completed)s)
UNION ALL
SELECT * FROM ONLY {segment}
WHERE state IN ('failed', 'cancelled') AND NOT has_dependents
  AND finalized_at >= now() - make_interval(secs => %(failed)s)
"""

# -- SEGMENT_EDGES --
# The dropped rows' own dependency edges go with them, as PRUNE_FINISHED's
# do (the kept rows are in awa_job_done by now). Index: the primary key of
# awa_job_dependency over the segment's id range, then primary key lookups.
SEGMENT_EDGES = """
DELETE FROM awa_job_dependency AS e
WHERE e.job_id BETWEEN (SELECT min(id) FROM ONLY {segment}) AND (SELECT max(id) FROM ONLY {segment})
  AND EXISTS (SELECT 1 FROM ONLY {segment} AS s WHERE s.id = e.job_id)
  AND NOT EXISTS (SELECT 1 FROM ONLY awa_job_done AS d WHERE d.id = e.job_id)
"""

DROP_SEGMENT = "DROP TABLE {segment}"

# -- ARCHIVE_FINISHED --
# Move a batch of finished rows from awa_job into awa_job_done, so awa_job
# holds live jobs and new ones land in pages VACUUM emptied. A row that holds
# its unique key stays: the unique index awa_job_unique_idx is on awa_job
# alone. Rows locked by anyone (an operator retrying one) are left for the
# next batch. Columns go by position: the child inherits awa_job's columns,
# including any added later, in awa_job's order. ARCHIVE_SINCE looks only at
# rows finished from %(since)s on.
# Index: awa_job_archive_idx (finalized_at), partial on this WHERE clause:
# finished rows that hold their key are not in it, and the entries of rows
# already moved (dead until VACUUM) lie before %(since)s.
_ARCHIVE = f"""
WITH moved AS (
    DELETE FROM ONLY awa_job WHERE id IN (
        SELECT id FROM ONLY awa_job
        WHERE state IN {_FINAL}
          AND (unique_key IS NULL OR NOT coalesce(unique_states ? state, false)){{since}}
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING *
)
INSERT INTO awa_job_done SELECT * FROM moved
"""
ARCHIVE_FINISHED = _ARCHIVE.format(since="")
ARCHIVE_SINCE = _ARCHIVE.format(since="\n          AND finalized_at >= %(since)s")

# -- ARCHIVE_WATERMARK --
# The database clock, less a margin: after a pass that moved every finished
# row it found, rows finished before this are behind ARCHIVE_SINCE's bound.
ARCHIVE_WATERMARK = "SELECT now() - make_interval(secs => %(margin)s)"

# -- AUTOVACUUM_STATE --
# Whether autovacuum will visit awa_job: on for the server, and not turned off
# for the table (a new maintenance leader warns if not); and whether awa_job
# has more dead row versions, counted by the statistics system, than
# autovacuum's threshold for it (the table's autovacuum_vacuum_threshold and
# scale factor, which migration 0001 sets, else the server's), and how many:
# the VACUUM that Maintenance.vacuum runs where autovacuum will not.
AUTOVACUUM_STATE = """
SELECT current_setting('autovacuum')::boolean,
       coalesce(o.opt ->> 'autovacuum_enabled', 'true')::boolean,
       coalesce(s.n_dead_tup, 0) > coalesce(o.opt ->> 'autovacuum_vacuum_threshold',
                                            current_setting('autovacuum_vacuum_threshold'))::float8
           + coalesce(o.opt ->> 'autovacuum_vacuum_scale_factor',
                      current_setting('autovacuum_vacuum_scale_factor'))::float8
             * greatest(c.reltuples, 0),
       coalesce(s.n_dead_tup, 0)
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
CROSS JOIN LATERAL (SELECT coalesce(jsonb_object_agg(option_name, option_value), '{}') AS opt
                    FROM pg_options_to_table(c.reloptions)) AS o
WHERE c.oid = 'awa_job'::regclass
"""

# -- VACUUM_JOBS --
# What autovacuum would run on awa_job. SKIP_LOCKED: a VACUUM already running
# (another leader's, or an operator's) makes this one a no-op. TRUNCATE
# false: giving the empty pages at the end back takes an exclusive lock,
# which would stall every claim meanwhile. ONLY (PostgreSQL 18 vacuums an
# inheritance parent's children too; the keyword is new there): awa_job_done
# only takes inserts. Not in a transaction block.
VACUUM_JOBS = "VACUUM (SKIP_LOCKED, TRUNCATE false) awa_job"
VACUUM_ONLY_JOBS = "VACUUM (SKIP_LOCKED, TRUNCATE false) ONLY awa_job"

# -- JOB_INDEXES --
# awa_job's indexes for Maintenance.reindex: each one's name, whether it is
# valid, its size in bytes, and the table's live rows (the statistics' count,
# or the last VACUUM's or ANALYZE's estimate if that is larger). Reads only the
# catalogs; pg_relation_size is a stat() of the index's files.
JOB_INDEXES = """
SELECT c.relname, i.indisvalid, pg_relation_size(c.oid), live.n
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
CROSS JOIN (SELECT greatest(coalesce(s.n_live_tup, 0), t.reltuples::bigint, 0) AS n
            FROM pg_class AS t LEFT JOIN pg_stat_user_tables AS s ON s.relid = t.oid
            WHERE t.oid = 'awa_job'::regclass) AS live
WHERE i.indrelid = 'awa_job'::regclass
ORDER BY c.relname
"""

# -- SERVER_CONNECTIONS --
# What the server lets this login open, read by the worker at start-up and by
# the system check awa.W101: max_connections and the slots it keeps back
# (superuser_reserved_connections, and reserved_connections from PostgreSQL
# 16), the client backends open now, and the login role's and the database's
# CONNECTION LIMIT (-1: none) with the backends each has open. inet_server_port()
# is the port the server was reached on: another than the one connected to
# means a pooler (PgBouncer) in between. Catalog reads, no lock.
SERVER_CONNECTIONS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int
           + coalesce(current_setting('reserved_connections', true)::int, 0),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
       r.rolname, r.rolsuper, r.rolconnlimit,
       (SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'client backend' AND usesysid = r.oid),
       d.datname, d.datconnlimit,
       (SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'client backend' AND datid = d.oid),
       inet_server_port()
FROM pg_roles AS r, pg_database AS d
WHERE r.rolname = session_user AND d.datname = current_database()
"""

# -- APPLIED_MIGRATIONS --
# django-awa's migrations applied to this database, as Django records them
# (its MigrationRecorder's table), read by the worker at start-up to refuse a
# schema older than its code. The table is missing on a database never
# migrated. A few hundred rows, no lock.
APPLIED_MIGRATIONS = """
SELECT name FROM django_migrations WHERE app = 'django_awa'
"""

# -- WRITABLE_SERVER --
# Whether this session's server takes writes: not a hot standby (in
# recovery) and not read-only. Checked before competing for the maintenance
# lease, and after a handler's database error: after a failover a new
# connection can land on a node that is not (or no longer) the primary.
WRITABLE_SERVER = """
SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'
"""

# -- TAKE_LEASE --
# Become the maintenance leader if the lease has run out (or was never
# taken), bumping its term. The row is skipped, not waited for, while a
# leader's transaction holds it (RENEW_LEASE): a leader frozen inside one
# keeps it only until the server ends that transaction
# (idle_in_transaction_session_timeout, set by RENEW_LEASE). Needs a
# writable server: a hot standby refuses the UPDATE, so a worker whose
# connection lands on one never leads.
LEASE_NAME = "maintenance"
TAKE_LEASE = """
WITH free AS (
    SELECT name FROM awa_lease
    WHERE name = %(name)s AND lease_until < now()
    FOR UPDATE SKIP LOCKED
)
UPDATE awa_lease AS l
SET holder = %(holder)s, term = l.term + 1,
    lease_until = now() + make_interval(secs => %(ttl)s), acquired_at = now()
FROM free
WHERE l.name = free.name
RETURNING l.term
"""

# -- SEED_LEASE --
# The lease's row, should it be missing (migration 0007 inserts it).
SEED_LEASE = """
INSERT INTO awa_lease (name, lease_until) VALUES (%(name)s, '-infinity')
ON CONFLICT (name) DO NOTHING
"""

# -- RENEW_LEASE --
# The fence in front of each of the leader's transactions: renew the lease
# if this worker still holds it in this term, else match nothing (another
# worker took over while this one stood still). The row lock it takes lasts
# until the transaction ends, so no one takes over while a leader's write is
# under way. A transaction left open by a leader that froze is ended by the
# server after %(idle_ms)s ms of idleness, which frees the lease for others.
RENEW_LEASE = """
UPDATE awa_lease SET lease_until = now() + make_interval(secs => %(ttl)s)
WHERE name = %(name)s AND holder = %(holder)s AND term = %(term)s
RETURNING term, set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true)
"""

# -- RELEASE_LEASE --
# A leader shutting down hands the lease back at once.
RELEASE_LEASE = """
UPDATE awa_lease SET lease_until = '-infinity'
WHERE name = %(name)s AND holder = %(holder)s AND term = %(term)s
"""

# -- QUEUE_STATS --
# Counts per (queue, state), for queue_stats() and the admin.
QUEUE_STATS = """
SELECT queue, state, count(*) FROM awa_job GROUP BY queue, state
"""


# -- COUNTED_QUEUE_STATS --
# The same from the maintenance leader's last count (awa_job_count, a few rows),
# for the admin's queue overview on a large table: no job row is read.
COUNTED_QUEUE_STATS = "SELECT queue, state, count FROM awa_job_count"


# ==== Operator controls (control.py) ====

# -- REVIVE_DONE --
# Before a retry: move the finished rows among these ids (in these states)
# from awa_job_done (or a segment of it) back into awa_job, so the UPDATE that
# follows reads ONLY awa_job and returns them (awa_job_done's CHECK holds
# finished rows only; its BEFORE trigger would move a row and skip the update,
# returning nothing). The DELETE locks each moved row. Index: the primary key
# of awa_job_done and of each segment.
REVIVE_DONE = """
WITH moved AS (
    DELETE FROM awa_job_done
    WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
    RETURNING *
)
INSERT INTO awa_job SELECT * FROM moved
"""

# -- RETRY_JOBS --
# Make failed, cancelled or retryable jobs available now, attempts reset
# (awa.retry, and a bulk retry's batch). Run REVIVE_DONE for the ids first.
# Locks each row it changes. Index: awa_job's primary key.
RETRY_JOBS = f"""
UPDATE ONLY awa_job
SET state = 'available', attempt = 0, run_at = now(), finalized_at = NULL, snoozed = false,
    metadata = (metadata - 'awa_cancelled_by') || {_RETRIED_MARK},
    {_ATTEMPT_CLEARED}
WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
RETURNING {JOB_COLUMNS}
"""


# ==== Bulk operations over a filter (bulk.py) ====
#
# Each batch is one transaction over at most a few thousand ids, picked by
# keyset over id from the operator's filter: row locks on that batch only,
# held for the batch's statements (tens of milliseconds), never a table lock.

# -- CANCEL_JOBS --
# Cancel jobs that have not finished (awa.cancel: one; a bulk cancel: a
# batch). Locks the rows in id order
# (two batches never wait on each other in a cycle); returns each one's
# previous state, so running attempts can be told through NOTIFY awa_cancel.
# A live running sequence member (see below) keeps its key's place: a lease of
# kind SEQUENCE_HOLD_KIND for its attempt, held_until %(stale_after)s ahead (one
# a key; a stale one left by a dead worker is taken over), so the key's next
# member waits for its handler (_sequence_held), as a limited kind's key does.
CANCEL_JOBS = f"""
WITH old AS (
    SELECT id, state, run_lease, metadata ->> 'awa_sequence' AS seq,
           state = 'running'
           AND heartbeat_at >= now() - make_interval(secs => %(stale_after)s) AS live
    FROM ONLY awa_job
    WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
    ORDER BY id
    FOR UPDATE
),
sequence_held AS (
    INSERT INTO awa_limit_lease (kind, key, slot, job_id, run_lease, taken_at, held_until)
    SELECT DISTINCT ON (seq) '{SEQUENCE_HOLD_KIND}', seq, 0, id, run_lease, now(),
           now() + make_interval(secs => %(stale_after)s)
    FROM old WHERE live AND seq IS NOT NULL
    ORDER BY seq, id DESC
    ON CONFLICT (kind, key, slot) DO UPDATE
    SET job_id = EXCLUDED.job_id, run_lease = EXCLUDED.run_lease,
        taken_at = EXCLUDED.taken_at, held_until = EXCLUDED.held_until
)
UPDATE ONLY awa_job AS j
SET state = 'cancelled', finalized_at = now(),
    errors = {_errors_plus("j.", "%(error)s::text")},
    {_ATTEMPT_CLEARED}
FROM old
WHERE j.id = old.id
RETURNING old.state, {J_JOB_COLUMNS}
"""
# A running attempt with a fresh heartbeat (%(stale_after)s): its handler may go
# on in its worker, and its key's lease is kept (_released).
CANCEL_JOBS = _releasing(CANCEL_JOBS, exact=False, kept="SELECT id FROM old WHERE live")

# -- MOVE_JOBS --
# Move a batch of jobs that wait to run (not running, not finished) to another
# queue, but those of a kind whose awa.Limit holds on another queue (%(pinned)s:
# bulk.check_move refused them; one rekinded since stays). Index: awa_job's
# primary key.
MOVE_JOBS = """
UPDATE ONLY awa_job SET queue = %(queue)s
WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
  AND kind <> ALL(%(pinned)s::text[])
"""

# -- LOCK_TO_REKIND --
# The next %(limit)s jobs of one kind after id %(after)s that wait to run
# (%(states)s: not running, not finished), in the queues %(queues)s (NULL: every
# queue), locked until the rekind's transaction ends: a claim (SKIP LOCKED)
# passes them by from then on. A job a worker is claiming is waited for, and
# its state read again once the claim commits: claimed, it is left out and
# keeps its kind. No index holds kind: awa_job's primary key from %(after)s on,
# so the batches of one rekind scan ONLY awa_job once, never awa_job_done.
LOCK_TO_REKIND = """
SELECT id, args, state, queue, run_at, unique_key IS NOT NULL, metadata ->> 'awa_sequence'
FROM ONLY awa_job
WHERE kind = %(old_kind)s AND state = ANY(%(states)s::text[])
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
  AND id > %(after)s
ORDER BY id LIMIT %(limit)s
FOR UPDATE
"""

# -- FIND_UNIQUE_HOLDERS --
# Of the jobs %(ids)s, each to hold the unique key at the same place in
# %(unique_keys)s, one whose key another job holds already, that job, and the
# key. Index: awa_job_unique_idx (its predicate, unique_states ? state).
FIND_UNIQUE_HOLDERS = """
SELECT v.id, h.id, v.unique_key
FROM unnest(%(ids)s::bigint[], %(unique_keys)s::text[]) AS v(id, unique_key)
JOIN ONLY awa_job h
  ON h.unique_key = v.unique_key AND h.unique_states ? h.state AND h.id <> v.id
ORDER BY v.id
LIMIT 1
"""

# -- REKIND_JOBS --
# Give a batch of jobs LOCK_TO_REKIND locked another kind, after its JobArgs
# class was renamed; where %(remade)s, the unique key and states made for the
# new kind too (else the row keeps its own). Where %(sequence_keys)s has a key,
# it becomes the job's sequence key, and a job parked under its old key
# (PARKED_RUN_AT) gets its run_at back: no hand-off of its new key would
# restore it, and the next claim parks it again if a member before it under
# that key is unfinished. Index: awa_job's primary key.
REKIND_JOBS = f"""
UPDATE ONLY awa_job j
SET kind = %(new_kind)s,
    unique_key = CASE WHEN v.remade THEN v.unique_key ELSE j.unique_key END,
    unique_states = CASE WHEN v.remade THEN v.unique_states ELSE j.unique_states END,
    run_at = CASE WHEN v.sequence_key IS NOT NULL AND j.metadata ? '{SEQUENCE_RUN_AT_KEY}'
                  THEN (j.metadata ->> '{SEQUENCE_RUN_AT_KEY}')::timestamptz ELSE j.run_at END,
    metadata = CASE WHEN v.sequence_key IS NULL THEN j.metadata
                    ELSE (j.metadata - '{SEQUENCE_RUN_AT_KEY}')
                         || jsonb_build_object('awa_sequence', v.sequence_key) END
FROM unnest(%(ids)s::bigint[], %(remade)s::bool[], %(unique_keys)s::text[],
            %(unique_states)s::jsonb[], %(sequence_keys)s::text[])
     AS v(id, remade, unique_key, unique_states, sequence_key)
WHERE j.id = v.id AND j.state = ANY(%(states)s::text[])
"""

# -- FIND_SEQUENCES_SPLIT --
# After REKIND_JOBS, in its transaction: the unfinished jobs that still hold a
# sequence key the rekinded jobs left (%(left_keys)s: not rekinded, as a job
# running or in a queue not named), and the jobs under way (%(in_progress)s)
# holding one they joined (%(joined_keys)s): a rekinded job could start while
# they have not finished. The first %(limit)s, their state, key, and how many
# in all. Reads only. Index: awa_job_sequence_idx (its predicate, word for word).
FIND_SEQUENCES_SPLIT = f"""
SELECT id, state, metadata ->> 'awa_sequence', count(*) OVER () FROM ONLY awa_job
WHERE metadata ? 'awa_sequence' AND state NOT IN {_FINAL}
  AND ((metadata ->> 'awa_sequence') = ANY(%(left_keys)s::text[])
       OR ((metadata ->> 'awa_sequence') = ANY(%(joined_keys)s::text[])
           AND state = ANY(%(in_progress)s::text[])))
ORDER BY id LIMIT %(limit)s
"""

# -- COUNT_UNDER_WAY --
# The jobs of one kind, in the queues %(queues)s (NULL: every queue), whose
# attempt is under way (%(in_progress)s): what a rekind leaves alone. A scan
# of ONLY awa_job, as LOCK_TO_REKIND's.
COUNT_UNDER_WAY = """
SELECT count(*) FROM ONLY awa_job
WHERE kind = %(old_kind)s AND state = ANY(%(in_progress)s::text[])
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
"""

# -- PRIORITIZE_JOBS --
# Set the priority of a batch of jobs that wait to run; the priority aging
# kept (awa_original_priority) is dropped, so the new value is where aging
# starts from. Index: awa_job's primary key.
PRIORITIZE_JOBS = """
UPDATE ONLY awa_job SET priority = %(priority)s, metadata = metadata - 'awa_original_priority'
WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
"""

# -- DISCARD_JOBS --
# Delete a batch of jobs, finished ones in awa_job_done too. A running job's
# worker then finds no row for its (id, run_lease) and writes nothing. Their
# own dependency edges go with them, as PRUNE_FINISHED's do (edges naming them
# as a dependency stay: their dependents are settled by that rule). Returns
# how many jobs it deleted. Index: the primary key of awa_job_dependency.
DISCARD_JOBS = """
WITH gone AS (
    DELETE FROM awa_job WHERE id = ANY(%(ids)s::bigint[]) AND state = ANY(%(states)s::text[])
    RETURNING id
),
edges AS (
    DELETE FROM awa_job_dependency WHERE job_id = ANY(ARRAY(SELECT id FROM gone))
)
SELECT count(*) FROM gone
"""

# ==== External callbacks (callbacks.py) ====

# -- LOCK_BY_CALLBACK --
# Lock the job waiting on a callback id. Index: awa_job_callback_id_uniq (partial: where set).
LOCK_BY_CALLBACK = f"""
SELECT {JOB_COLUMNS} FROM awa_job WHERE callback_id = %(callback_id)s FOR UPDATE
"""


# -- RESOLVE_CALLBACK --
# Resolve a parked job (complete, fail or retry_external), locked by the caller.
RESOLVE_CALLBACK = f"""
UPDATE awa_job
SET state = %(state)s,
    finalized_at = CASE WHEN %(state)s IN {_FINAL} THEN now() END,
    attempt = CASE WHEN %(reset)s THEN 0 ELSE attempt END,
    run_at = CASE WHEN %(state)s = 'available' THEN now() ELSE run_at END,
    metadata = (metadata - 'awa_early_callback') || %(metadata)s::jsonb,
    errors = {_errors_plus("", "%(error)s::text")},
    callback_id = CASE WHEN %(state)s = 'available' THEN NULL ELSE callback_id END,
    callback_timeout_at = NULL
WHERE id = %(id)s
RETURNING {JOB_COLUMNS}
"""


# -- LOCK_BY_CALLBACKS --
# complete_external_many: the jobs parked on any of %(callback_ids)s, locked in
# id order (two batches sharing callbacks lock them in the same order).
# Index: awa_job_callback_id_uniq.
LOCK_BY_CALLBACKS = f"""
SELECT {JOB_COLUMNS} FROM ONLY awa_job WHERE callback_id = ANY(%(callback_ids)s::uuid[])
ORDER BY id FOR UPDATE
"""

# -- COMPLETE_CALLBACKS --
# RESOLVE_CALLBACK's completion for many locked waiting_external jobs at once,
# each with its own metadata ({"awa_callback_result": payload}). Primary key.
COMPLETE_CALLBACKS = f"""
UPDATE ONLY awa_job AS j
SET state = 'completed',
    finalized_at = now(),
    metadata = (j.metadata - 'awa_early_callback') || d.metadata,
    callback_timeout_at = NULL
FROM unnest(%(id)s::bigint[], %(metadata)s::jsonb[]) AS d(id, metadata)
WHERE j.id = d.id AND j.state = 'waiting_external'
RETURNING {J_JOB_COLUMNS}
"""


# -- RECORD_EARLY_CALLBACK --
# A callback answered while its handler still runs: kept on the row, applied on park.
RECORD_EARLY_CALLBACK = """
UPDATE awa_job SET metadata = metadata || jsonb_build_object('awa_early_callback', %(early)s::jsonb)
WHERE id = %(id)s
"""


# -- RECORD_RECEIPT --
# The callback receiver keeps the signature of a request it accepts, in the
# transaction that acts on it: a row back means it is new, none a replay (the
# primary key; a concurrent twin waits for the first to commit or roll back).
# One statement where get_or_create took a SELECT, a savepoint, an INSERT and
# a release.
RECORD_RECEIPT = """
INSERT INTO awa_callback_receipt (signature, received_at) VALUES (%(signature)s, now())
ON CONFLICT (signature) DO NOTHING
RETURNING true
"""

# -- RECORD_RECEIPTS --
# RECORD_RECEIPT for the batch receiver: the signatures returned are new.
RECORD_RECEIPTS = """
INSERT INTO awa_callback_receipt (signature, received_at)
SELECT s, now() FROM unnest(%(signatures)s::text[]) AS s
ON CONFLICT (signature) DO NOTHING
RETURNING signature
"""

# -- FORGET_RECEIPTS --
# The batch receiver's receipts of requests it answered 404, dropped in the
# same transaction (the one-callback receiver's roll back with the 404).
FORGET_RECEIPTS = """
DELETE FROM awa_callback_receipt WHERE signature = ANY(%(signatures)s::text[])
"""

# -- PRUNE_RECEIPTS --
# Forget receipts whose request would be refused as stale anyway.
# Index: awa_receipt_received_idx (received_at).
PRUNE_RECEIPTS = """
DELETE FROM awa_callback_receipt WHERE received_at < now() - make_interval(secs => %(keep)s)
"""


# -- EXTEND_CALLBACK --
# heartbeat_callback: push the callback's timeout out.
EXTEND_CALLBACK = f"""
UPDATE awa_job SET callback_timeout_at = now() + make_interval(secs => %(timeout)s)
WHERE id = %(id)s
RETURNING {JOB_COLUMNS}
"""


# ==== Django Tasks (backends.py) ====

# -- RECORD_TASK_ERROR --
# A Django Task's exception class and traceback, for TaskResult.errors.
RECORD_TASK_ERROR = """
UPDATE awa_job
SET metadata = jsonb_set(metadata, '{awa_task_errors}',
                         coalesce(metadata -> 'awa_task_errors', '[]'::jsonb) || %(error)s::jsonb)
WHERE id = %(id)s AND run_lease = %(run_lease)s AND state = 'running'
"""


# -- RECORD_TASK_STARTED --
# When a Django Task that may be retried first began (TaskResult.started_at), on the
# database clock as attempted_at; written once, by its first run. Primary key lookup.
RECORD_TASK_STARTED = """
UPDATE awa_job
SET metadata = metadata || jsonb_build_object('awa_task_started_at', statement_timestamp())
WHERE id = %(id)s AND run_lease = %(run_lease)s AND state = 'running'
  AND NOT metadata ? 'awa_task_started_at'
"""


# -- TASK_STILL_RUNNING --
# Whether a Django Task's attempt is still its row's (not cancelled or rescued while
# its function ran): then the worker's outcome stands. Primary key lookup.
TASK_STILL_RUNNING = """
SELECT 1 FROM awa_job WHERE id = %(id)s AND run_lease = %(run_lease)s AND state = 'running'
"""


# ==== The admin (admin.py) ====

# -- TABLE_BYTES --
# The size of the heaps of awa_job and its finished rows (awa_job_done and its
# segments), from the catalog.
_DONE_TABLES = """
    SELECT to_regclass('awa_job_done')
    UNION ALL
    SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = to_regclass('awa_job_done')"""
_JOB_TABLES = f"(SELECT 'awa_job'::regclass UNION ALL {_DONE_TABLES})"
TABLE_BYTES = f"SELECT sum(pg_relation_size(oid))::bigint FROM pg_class WHERE oid IN {_JOB_TABLES}"


# -- ESTIMATED_ROWS --
# The planner's row estimate for awa_job and its finished rows together (-1
# while none has been analyzed; one never analyzed counts as empty).
ESTIMATED_ROWS = f"""
SELECT CASE WHEN max(reltuples) < 0 THEN -1 ELSE sum(greatest(reltuples, 0)) END::bigint
FROM pg_class WHERE oid IN {_JOB_TABLES}
"""


# -- DISTINCT_QUEUES --
# Every queue name: a sequential scan, run only on a small table.
DISTINCT_QUEUES = "SELECT DISTINCT queue FROM awa_job LIMIT %(limit)s"


# -- DISTINCT_KINDS --
# Every kind: a sequential scan, run only on a small table.
DISTINCT_KINDS = "SELECT DISTINCT kind FROM awa_job LIMIT %(limit)s"


# -- AVAILABLE_QUEUES --
# Queues holding available jobs, by a loose index scan of the partial claim
# index awa_job_claim_idx (queue, priority, run_at, id) WHERE state = 'available':
# one index probe per queue.
AVAILABLE_QUEUES = """
WITH RECURSIVE queues(queue, n) AS (
    (SELECT queue, 1 FROM ONLY awa_job WHERE state = 'available' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM ONLY awa_job AS j
            WHERE j.state = 'available' AND j.queue > queues.queue
            ORDER BY j.queue LIMIT 1),
           queues.n + 1
    FROM queues
    WHERE queues.queue IS NOT NULL AND queues.n < %(limit)s
)
SELECT queue FROM queues WHERE queue IS NOT NULL
"""


# -- SAMPLED_VALUES --
# Values of one awa_job column in the planner's statistics, as of the last
# (auto)ANALYZE: most common values and histogram bounds. A catalog read.
SAMPLED_VALUES = f"""
SELECT unnest(coalesce(most_common_vals::text::text[], '{{}}')
              || coalesce(histogram_bounds::text::text[], '{{}}'))
FROM pg_stats
WHERE schemaname = current_schema() AND attname = %(column)s
  AND tablename IN (SELECT relname FROM pg_class WHERE oid IN {_JOB_TABLES})
"""

# -- PREPARED --
# The per-job statements run as prepared statements (AWA["PREPARED_STATEMENTS"]).
# After five runs PostgreSQL may plan a prepared statement once for any
# parameters (a generic plan); these keep their plan that way: the claim
# follows awa_job_claim_idx in its ORDER BY, the inserts read no table. Not
# listed: statements that join awa_job to arrays (FINALIZE, COMPLETE,
# HEARTBEAT, SET_PROGRESS, MARK_STARTED). Their generic plan does not know the array's length, and
# with the statistics of a quiet table it scanned every running row for each
# batch instead of looking ids up by primary key, so they are planned on each
# run. So are HAND_ON and COMPLETE_HAND_ON (a generic plan of the latter read
# an index of the running rows for them and scanned awa_job for the next ones),
# but not COMPLETE_HAND_ON_ONE, the same for one member with scalars: its plan for
# any parameters is its plan for each (primary key, awa_job_sequence_idx), and
# its parsing and planning took longer than its run (a saturated sequence runs
# it for every member), and not the COMPLETE_ONE and FINALIZE_ONE forms (for
# one outcome), for the same reasons.
PREPARED = frozenset(
    {
        INSERT_ONE,
        INSERT_ONE_UNIQUE,
        INSERT_ONE_QUIET,
        INSERT_ONE_UNIQUE_QUIET,
        RESERVE_IDS,
        INSERT_MANY,
        NOTIFY_QUEUES,
        CLAIM,
        CLAIM_UNFLUSHED,
        CLAIM_SEQUENCED,
        CLAIM_LIMITED,
        CLAIM_KEYED,
        LOCK_LIMITS,
        COMPLETE_HAND_ON_ONE,
        COMPLETE_ONE,
        COMPLETE_ONE_STANDALONE,
        COMPLETE_ONE_RETURNING_ROWS,
        FINALIZE_ONE,
        FINALIZE_ONE_STANDALONE,
        FINALIZE_ONE_RETURNING_ROWS,
    }
)
# COMPLETE's forms for one outcome are prepared in their FORGETTING form too.
PREPARED |= {FORGETTING[statement] for statement in FORGETTING.keys() & PREPARED}


# ==== The fleet and its figures (fleet.py, metrics.py) ====

# -- BEAT_WORKER --
# A worker process says it is alive: registered at start and renewed with each
# heartbeat (an upsert, so a row the leader pruned while the worker was cut
# off comes back). Locks its own row of awa_worker only, by primary key.
BEAT_WORKER = """
INSERT INTO awa_worker (id, name, host, pid, queues, concurrency, version, started_at,
                        last_seen_at, running_ids, running)
VALUES (%(id)s, %(name)s, %(host)s, %(pid)s, %(queues)s::jsonb, %(concurrency)s, %(version)s,
        %(started_at)s, now(), %(running_ids)s::jsonb, %(running)s)
ON CONFLICT (id) DO UPDATE
SET last_seen_at = now(), running_ids = EXCLUDED.running_ids, running = EXCLUDED.running
"""

# -- ORPHANED_QUEUES --
# The queues holding jobs that wait to run (%(states)s) that nothing names:
# none of %(named)s (AWA["QUEUES"], the queues kinds and periodic schedules
# declare, the starting worker's) and no worker seen within %(stale_after)s
# seconds runs them (awa_worker.queues). Each with its count of such jobs,
# for a worker's start-up warning (awa.W102). A scan of ONLY awa_job, as
# COUNT_JOBS; awa_worker is a row per worker process.
ORPHANED_QUEUES = """
SELECT queue, count(*) FROM ONLY awa_job
WHERE state = ANY(%(states)s::text[]) AND queue <> ALL(%(named)s::text[])
  AND queue NOT IN (
      SELECT jsonb_object_keys(queues) FROM awa_worker
      WHERE last_seen_at >= now() - make_interval(secs => %(stale_after)s))
GROUP BY queue ORDER BY queue
"""

# -- DEREGISTER_WORKER --
# A worker that stopped takes its row away, and gives back the slots it leased
# (its handlers are done). By primary key; awa_queue_slot_worker_idx.
DEREGISTER_WORKER = """
WITH slots AS (DELETE FROM awa_queue_slot WHERE worker_id = %(id)s)
DELETE FROM awa_worker WHERE id = %(id)s
"""

# -- MARK_MAINTAINED --
# The maintenance leader ran a tick: what <prefix>/health judges. By primary key.
MARK_MAINTAINED = "UPDATE awa_worker SET maintained_at = now() WHERE id = %(id)s"

# -- PRUNE_WORKERS --
# Delete the rows of workers that stopped renewing them STALE_AFTER ago (killed,
# or on a host that went away). awa_worker holds one row per live process:
# a sequential scan.
PRUNE_WORKERS = """
DELETE FROM awa_worker WHERE last_seen_at < now() - make_interval(secs => %(stale_after)s)
"""

# -- HEALTH_TIMEOUT --
# A health probe's statements may take 2 s before the database counts as not
# answering (SET LOCAL: for the probe's own transaction only).
HEALTH_TIMEOUT = "SET LOCAL statement_timeout = 2000"

# -- LAST_MAINTAINED --
# Seconds since a leader last ran a maintenance tick (NULL: none recorded), and
# the database clock, for <prefix>/health.
LAST_MAINTAINED = """
SELECT extract(epoch FROM now() - max(maintained_at))::float8, now() FROM awa_worker
"""

# -- COUNT_JOBS --
# The maintenance leader's count of jobs per queue and state, replacing the
# rollup that <prefix>/metrics reads (run inside one transaction, so a reader
# sees the old counts or the new). Reads ONLY awa_job: live jobs, and finished
# ones not yet moved to awa_job_done (archive() moves them within a tick); the
# millions of finished rows there are not scanned. A sequential scan of
# awa_job, no lock beyond the rollup's rows.
CLEAR_JOB_COUNTS = "DELETE FROM awa_job_count"
COUNT_JOBS = """
INSERT INTO awa_job_count (queue, state, count, oldest_run_at, counted_at)
SELECT queue, state, count(*), min(run_at) FILTER (WHERE state = 'available'), now()
FROM ONLY awa_job GROUP BY queue, state
"""

# -- DONE_ROWS_ESTIMATE --
# The planner's estimate of finished rows in awa_job_done and its segments
# (pg_class.reltuples; -1 before any was first analyzed or vacuumed, one never
# analyzed counting as empty), for <prefix>/metrics.
DONE_ROWS_ESTIMATE = f"""
SELECT coalesce(CASE WHEN max(reltuples) < 0 THEN -1 ELSE sum(greatest(reltuples, 0)) END,
                -1)::bigint
FROM pg_class WHERE oid IN ({_DONE_TABLES})
"""

# ==== Dashboard and dead letters (dashboard.py, dead_letters.py) ====
#
# The admin dashboard draws awa_stat_minute, never awa_job: each worker's
# heartbeat inserts the outcomes it counted into rows of its own
# (awa_stat_delta), and the maintenance leader, the rollup's only writer,
# folds them in each maintenance interval. No counter row is locked by
# finalize or shared between workers.

# -- FLUSH_TALLY --
# A worker's outcome counts since its last heartbeat, one row per queue, at
# the database clock's minute. Insert-only: no lock another worker waits on.
FLUSH_TALLY = """
INSERT INTO awa_stat_delta (worker, queue, minute, completed, failed, retried, wait)
SELECT %(worker)s, t.queue, date_trunc('minute', now()), t.completed, t.failed, t.retried,
       t.wait::jsonb
FROM unnest(%(queue)s::text[], %(completed)s::bigint[], %(failed)s::bigint[],
            %(retried)s::bigint[], %(wait)s::text[])
     AS t(queue, completed, failed, retried, wait)
"""

# -- TAKE_STAT_DELTAS --
# The leader takes up to %(limit)s flushed rows, oldest first (deleted in its
# fenced transaction, so a lost lease puts them back). Rows flushed meanwhile
# wait for the next pass. Index: the primary key.
TAKE_STAT_DELTAS = """
DELETE FROM awa_stat_delta WHERE id IN (
    SELECT id FROM awa_stat_delta ORDER BY id LIMIT %(limit)s
)
RETURNING queue, minute, completed, failed, retried, wait
"""

# -- READ_STAT_MINUTES --
# The rollup rows the taken deltas add to, locked until the leader rewrites
# them. Index: awa_stat_minute_uniq (minute, queue).
READ_STAT_MINUTES = """
SELECT m.queue, m.minute, m.completed, m.failed, m.retried, m.wait
FROM awa_stat_minute AS m
JOIN unnest(%(queue)s::text[], %(minute)s::timestamptz[]) AS k(queue, minute)
  ON m.queue = k.queue AND m.minute = k.minute
FOR UPDATE OF m
"""

# -- WRITE_STAT_MINUTES --
# Store the sums the leader computed (old row plus the taken deltas).
WRITE_STAT_MINUTES = """
INSERT INTO awa_stat_minute (queue, minute, completed, failed, retried, wait)
SELECT t.queue, t.minute, t.completed, t.failed, t.retried, t.wait::jsonb
FROM unnest(%(queue)s::text[], %(minute)s::timestamptz[], %(completed)s::bigint[],
            %(failed)s::bigint[], %(retried)s::bigint[], %(wait)s::text[])
     AS t(queue, minute, completed, failed, retried, wait)
ON CONFLICT (minute, queue) DO UPDATE SET
    completed = excluded.completed, failed = excluded.failed,
    retried = excluded.retried, wait = excluded.wait
"""

# -- RECORD_OLDEST_DUE --
# Each queue's oldest available job's age in this minute, from the counts the
# leader just wrote (awa_job_count: no scan of awa_job); the most in a minute
# is kept. Queues with nothing due get no row here.
RECORD_OLDEST_DUE = """
INSERT INTO awa_stat_minute (queue, minute, completed, failed, retried, wait, oldest_due)
SELECT queue, date_trunc('minute', counted_at), 0, 0, 0, '[]'::jsonb,
       greatest(extract(epoch FROM counted_at - oldest_run_at), 0)::float8
FROM awa_job_count WHERE state = 'available' AND oldest_run_at IS NOT NULL
ON CONFLICT (minute, queue) DO UPDATE SET
    oldest_due = greatest(awa_stat_minute.oldest_due, excluded.oldest_due)
"""

# -- PRUNE_STAT_MINUTES --
# Forget rollup minutes older than the dashboard draws. Index: awa_stat_minute_uniq.
PRUNE_STAT_MINUTES = """
DELETE FROM awa_stat_minute WHERE minute < now() - make_interval(secs => %(keep)s)
"""

# -- DASHBOARD_WINDOW --
# The database clock and the start of a window of %(window)s seconds ending
# with the current minute: the charts' edges.
DASHBOARD_WINDOW = """
SELECT now(), date_trunc('minute', now()) + interval '1 minute' - make_interval(secs => %(window)s)
"""

# -- DASHBOARD_MINUTES --
# The rollup rows from %(start)s on, each with the chart point it falls in
# (%(step)s seconds a point). Index: awa_stat_minute_uniq (minute leads); at
# most a row per queue and minute.
DASHBOARD_MINUTES = """
SELECT queue, (extract(epoch FROM minute - %(start)s)::bigint / %(step)s)::int,
       completed, failed, retried, wait, oldest_due
FROM awa_stat_minute WHERE minute >= %(start)s
"""

# -- DEAD_LETTER_GROUPS --
# Failed (exhausted) jobs grouped by queue, kind and the first line of their
# last error (models.ERROR_LINE_SQL, the key Job.objects.with_error filters
# by), over the newest %(cap)s failed rows only, so the page costs the same
# with a million of them. Index: awa_job_finalized_idx (state,
# finalized_at) on awa_job and awa_job_done, read backwards (a merge append).
DEAD_LETTER_GROUPS = f"""
SELECT f.queue, f.kind, f.error, count(*), min(f.finalized_at), max(f.finalized_at)
FROM (
    SELECT queue, kind, finalized_at, {ERROR_LINE_SQL} AS error
    FROM awa_job WHERE state = 'failed'
    ORDER BY finalized_at DESC LIMIT %(cap)s
) AS f
GROUP BY f.queue, f.kind, f.error
ORDER BY count(*) DESC, max(f.finalized_at) DESC
"""

# ==== Dependencies and workflows (dependencies.py) ====
#
# A job waiting on others is 'blocked' and has one awa_job_dependency row per
# dependency. Its promotion (or cancellation) happens in the transaction that
# writes the outcome of a dependency, for the jobs whose row says
# has_dependents. Concurrency: each transaction writes its dependencies'
# outcomes first, then locks the blocked dependents (LOCK_DEPENDENTS, FOR
# UPDATE, in id order), then judges them in a later statement
# (CANCEL_BY_DEPENDENCY, PROMOTE_READY), whose snapshot is taken once the lock
# is held. Of two transactions finishing the last two dependencies of one job
# at once, the second to lock the dependent sees the first's committed outcome
# and promotes it; the first saw the other still running and left it. Only the
# tail of each transaction (judge and commit) waits on the dependent's lock.
# Worker outcomes go further (dependencies._lock_to_judge): while a dependent
# has a dependency that is neither finished nor running (PENDING_OF), its
# outcome will come later and settle the dependent, so this transaction only
# takes a KEY SHARE lock (SHARE_BLOCKED), shared by all such transactions and
# waited for by the FOR UPDATE of the one that judges. A dependency whose
# outcome is being written was 'running' in everyone's snapshot, so two
# outcomes written at once never leave the dependent to each other.
# Outcomes that all completed go first through PROMOTE_MET_BY: a dependent
# all of whose dependencies are among them has no dependency another
# transaction could finish, so it is promoted without the lock pass.

# -- PLAN_BY_INDEX --
# Before the dependency statements of one settling (dependencies._settle):
# plan them by index whatever the statistics say, for this transaction only
# (set_config(..., true) is SET LOCAL), and return the settings as they were
# (PLAN_AS_BEFORE puts them back). Every statement here reaches its rows
# through an index on awa_job_dependency or a primary key; but a workflow
# enqueued in a burst is drained before autoanalyze has seen its edges (or
# with autovacuum off), and without statistics the planner takes the
# per-dependent subqueries for a few pages' seq scan each: 16,200 dependents
# promoted at once took 30 s instead of 0.25 s (benchmarks/workflows.py).
# JIT off too: compiling a big promotion costs more than running it.
PLAN_BY_INDEX = """
SELECT current_setting('enable_seqscan'), current_setting('jit'),
       set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)
"""

# -- PLAN_AS_BEFORE --
# After the dependency statements: the settings PLAN_BY_INDEX returned, back,
# for the rest of the caller's transaction.
PLAN_AS_BEFORE = """
SELECT set_config('enable_seqscan', %(seqscan)s, true), set_config('jit', %(jit)s, true)
"""

# -- FLAG_DEPENDENCIES --
# At enqueue of jobs with `after`: mark the named existing jobs as having
# dependents and read their states. The UPDATE holds each row's lock until the
# enqueuing transaction ends, so an outcome being written for one of them is
# waited for (and its new state read here), and one written later waits for
# this commit and reads the flag (FINALIZE). Primary key lookups on awa_job
# and awa_job_done (a finished dependency counts at once).
FLAG_DEPENDENCIES = """
UPDATE awa_job SET has_dependents = true
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id, state, workflow_id
"""

# -- INSERT_STEPS --
# INSERT_MANY for jobs with dependencies (a Workflow's steps, or jobs given
# `after`), with ids drawn beforehand: each with its workflow, its
# has_dependents flag (another new job depends on it) and 'blocked' when it
# has dependencies, to be settled (promoted or cancelled) in the same
# transaction. ON CONFLICT skips unique duplicates (absent from RETURNING).
INSERT_STEPS = f"""
INSERT INTO awa_job (id, {_INSERT_COLUMNS}, workflow_id, has_dependents)
SELECT d.id, d.kind, d.queue, d.args,
       CASE WHEN d.blocked THEN 'blocked' WHEN d.run_at > now() THEN 'scheduled'
            ELSE 'available' END,
       d.priority, d.max_attempts,
       coalesce(d.run_at, now()),
       d.tags, d.metadata, d.unique_key, d.unique_states, d.workflow_id, d.has_dependents
FROM unnest(%(id)s::bigint[], %(kind)s::text[], %(queue)s::text[], %(args)s::jsonb[],
            %(priority)s::smallint[], %(max_attempts)s::smallint[],
            %(run_at)s::timestamptz[], %(tags)s::jsonb[], %(metadata)s::jsonb[],
            %(unique_key)s::text[], %(unique_states)s::jsonb[], %(blocked)s::bool[],
            %(workflow_id)s::uuid[], %(has_dependents)s::bool[])
     AS d(id, kind, queue, args, priority, max_attempts, run_at, tags, metadata,
          unique_key, unique_states, blocked, workflow_id, has_dependents)
{UNIQUE_CONFLICT_CLAUSE}
RETURNING id, state, queue
"""

# -- INSERT_EDGES --
# The dependency edges of newly inserted jobs, one row each.
INSERT_EDGES = """
INSERT INTO awa_job_dependency (job_id, depends_on_id, position, requires)
SELECT * FROM unnest(%(job_id)s::bigint[], %(depends_on_id)s::bigint[],
                     %(position)s::int[], %(requires)s::text[])
"""

# -- LOCK_DEPENDENTS --
# The blocked jobs depending on any of these jobs, whose outcome this
# transaction wrote: locked in id order (two transactions lock shared
# dependents in the same order), and skipped if no longer blocked once the
# lock is had. Index: awa_dependency_dependents_idx (depends_on_id, job_id),
# then primary key lookups.
LOCK_DEPENDENTS = """
SELECT j.id FROM ONLY awa_job AS j
WHERE j.id IN (SELECT e.job_id FROM awa_job_dependency AS e
               WHERE e.depends_on_id = ANY(%(ids)s::bigint[]))
  AND j.state = 'blocked'
ORDER BY j.id
FOR UPDATE OF j
"""

# -- LOCK_BLOCKED --
# The same for jobs named directly (new ones, retried ones). Primary key lookups.
LOCK_BLOCKED = """
SELECT id FROM ONLY awa_job WHERE id = ANY(%(ids)s::bigint[]) AND state = 'blocked'
ORDER BY id
FOR UPDATE
"""

# -- CANCEL_BY_DEPENDENCY --
# Cancel the locked blocked jobs one of whose requires='completed'
# dependencies failed or was cancelled: among %(finished)s (the outcomes this
# transaction wrote), or among all of them when NULL (new or retried jobs).
# A requires='completed' dependency whose row is gone was deleted before it
# finished (admin discard, ORM or raw DELETE; a completed one's edges go
# with it, MEET_BY_DELETION, PRUNE_FINISHED): it counts as
# cancelled, its state given as 'deleted', when %(finished)s is NULL (the
# deleting transaction, maintenance's settle_orphans). An outcome's
# transaction looks at its own outcomes only (a fan-in callback's 10,000
# edges are not read for each batch): PROMOTE_READY leaves such a job
# blocked, and maintenance cancels it.
# The errors entry names the first such dependency in `after` order, and
# metadata.awa_cancelled_by keeps its id (a retry of it reopens this job).
# Index: the primary key (job_id, depends_on_id) of awa_job_dependency, then
# primary key lookups of the dependencies in awa_job and awa_job_done.
_CULPRIT = "%(prefix)s || c.dep_id || coalesce(' (' || c.dep_kind || ') ', ' ') || c.dep_state"
CANCEL_BY_DEPENDENCY = f"""
WITH culprit AS (
    SELECT DISTINCT ON (e.job_id) e.job_id, e.depends_on_id AS dep_id, d.kind AS dep_kind,
           coalesce(d.state, 'deleted') AS dep_state
    FROM awa_job_dependency AS e
    LEFT JOIN awa_job AS d ON d.id = e.depends_on_id
    WHERE e.job_id = ANY(%(ids)s::bigint[]) AND e.requires = 'completed'
      AND CASE WHEN %(finished)s::bigint[] IS NULL THEN d.id IS NULL
                                                    OR d.state IN ('failed', 'cancelled')
               ELSE e.depends_on_id = ANY(%(finished)s::bigint[])
                    AND d.state IN ('failed', 'cancelled') END
    ORDER BY e.job_id, e.position
)
UPDATE ONLY awa_job AS j
SET state = 'cancelled', finalized_at = now(),
    errors = {_errors_plus("j.", _CULPRIT)},
    metadata = j.metadata || jsonb_build_object('awa_cancelled_by', c.dep_id)
FROM culprit AS c
WHERE j.id = c.job_id AND j.state = 'blocked'
RETURNING c.dep_id, c.dep_kind, c.dep_state, {J_JOB_COLUMNS}
"""

# -- TRIGGER_EDGES --
# With the otel extra, after a promotion: which of the dependencies whose
# outcome this transaction wrote (%(finished)s) each promoted dependent waited
# for, with the trace context each dependency recorded when it was enqueued
# (its awa_trace headers; NULL without), to link to when its attempt span is
# not in this process. Index: the primary key of awa_job_dependency (job_id,
# depends_on_id), one lookup per pair; the dependency's row by its primary key.
TRIGGER_EDGES = """
SELECT e.job_id, e.depends_on_id, d.metadata -> 'awa_trace' ->> 'traceparent',
       d.metadata -> 'awa_trace' ->> 'tracestate'
FROM awa_job_dependency AS e
LEFT JOIN awa_job AS d ON d.id = e.depends_on_id
WHERE e.job_id = ANY(%(ids)s::bigint[]) AND e.depends_on_id = ANY(%(finished)s::bigint[])
"""

# -- ADD_TRACE_LINKS --
# Append W3C headers (a JSON array each) to promoted dependents'
# metadata["awa_trace"]["links"]: their attempt spans link to the attempts
# that released them (otel.py). The rows are the promotion's, locked by this
# transaction already. Index: the primary key.
ADD_TRACE_LINKS = """
UPDATE ONLY awa_job AS j
SET metadata = j.metadata || jsonb_build_object('awa_trace', t.trace || jsonb_build_object(
        'links', CASE WHEN jsonb_typeof(t.trace -> 'links') = 'array'
                      THEN t.trace -> 'links' ELSE '[]'::jsonb END || t.links))
FROM (
    SELECT k.id, k.links::jsonb AS links,
           CASE WHEN jsonb_typeof(m.metadata -> 'awa_trace') = 'object'
                THEN m.metadata -> 'awa_trace' ELSE '{}'::jsonb END AS trace
    FROM unnest(%(ids)s::bigint[], %(links)s::text[]) AS k(id, links)
    JOIN ONLY awa_job AS m ON m.id = k.id
) AS t
WHERE j.id = t.id AND jsonb_typeof(j.metadata) = 'object'
"""

# -- PROMOTE_READY --
# Of the locked blocked jobs, make those whose every dependency reached what
# it requires available (or scheduled, while their run_at is ahead). A
# dependency's row that no longer exists counts as finished, not completed:
# it was deleted (before it finished, or pruned after; a completed one's
# edges go with it). Index: the primary key of
# awa_job_dependency (job_id, ...), the newest dependencies first (in a
# fan-in, those still running), stopping at the first unmet one; primary key
# lookups of the dependencies. The order is kept in a subquery: PostgreSQL
# drops ORDER BY and LIMIT written directly in an EXISTS, and the members
# finishing last in a fan-in of 10,000 would each read ~10,000 finished
# dependencies (60-100 ms at load 14) before the running ones, while they hold
# the callback FOR UPDATE; 16-20 ms in this order.
# Each dependency's state is looked up in awa_job_done_current first, where a
# completed job is written at once, then in awa_job_done and its older
# segments (an archived one moves there), then in awa_job: one primary key
# lookup for a dependency finished since the last rotation, not two (the
# parent table's lookup would find nothing first), which halves the check
# that reads all of a fan-in callback's 10,000 dependencies when its last
# member finishes. OFFSET 0 keeps the lookup from being inlined into the
# CASE, where it would run once per mention.
PROMOTE_READY = f"""
UPDATE ONLY awa_job AS j
SET state = CASE WHEN j.run_at > now() THEN 'scheduled' ELSE 'available' END
WHERE j.id = ANY(%(ids)s::bigint[]) AND j.state = 'blocked'
  AND NOT EXISTS (
      SELECT 1 FROM (SELECT e.depends_on_id, e.requires FROM awa_job_dependency AS e
                     WHERE e.job_id = j.id ORDER BY e.depends_on_id DESC) AS e
      CROSS JOIN LATERAL (
          SELECT coalesce(
              (SELECT f.state FROM ONLY awa_job_done_current AS f WHERE f.id = e.depends_on_id),
              (SELECT f.state FROM awa_job_done AS f WHERE f.id = e.depends_on_id),
              (SELECT l.state FROM ONLY awa_job AS l WHERE l.id = e.depends_on_id))
          OFFSET 0
      ) AS d(state)
      WHERE CASE WHEN d.state IS NULL THEN e.requires = 'completed'
                 ELSE d.state <> 'completed'
                      AND (e.requires = 'completed' OR d.state NOT IN {_FINAL}) END
  )
RETURNING j.id, j.state, j.queue
"""

# -- PROMOTE_MET_BY --
# The first statement of a settling whose outcomes all completed (a worker's
# batch, usually): the blocked jobs every one of whose dependencies is among
# these jobs become available (or scheduled) at once. No lock before, no
# judging after: no other transaction can write an outcome of their
# dependencies (this one holds those rows, having written them), so none
# races this one to judge them, and all completed (the caller says so). The
# UPDATE's own row lock and its recheck of state = 'blocked' keep a job
# cancelled or promoted meanwhile as it is; the rows are taken in id order,
# as every settling locks them. This is a chain's next step and
# each job of a fan-out: one statement for the 18,000 dependents a batch of
# 200 steps promotes in benchmarks/workflows.py, where the general path
# (DEPENDENTS_TO_JUDGE, LOCK_BLOCKED, PROMOTE_READY) read each dependent three
# times. Dependents with another dependency are left to that path. Index:
# awa_dependency_dependents_idx for the dependents, then the primary key of
# awa_job_dependency, reading at most n + 1 of a dependent's edges (n: its
# edges to these jobs), and awa_job's primary key. A last row of NULLs says
# that some dependents were left (so the general path must look for them);
# without it, the settling is done.
PROMOTE_MET_BY = """
WITH mine AS MATERIALIZED (
    SELECT e.job_id, count(*) AS n FROM awa_job_dependency AS e
    WHERE e.depends_on_id = ANY(%(ids)s::bigint[])
    GROUP BY e.job_id
    ORDER BY e.job_id
),
promoted AS (
    UPDATE ONLY awa_job AS j
    SET state = CASE WHEN j.run_at > now() THEN 'scheduled' ELSE 'available' END
    FROM mine
    WHERE j.id = mine.job_id AND j.state = 'blocked'
      AND (SELECT count(*) FROM (SELECT 1 FROM awa_job_dependency AS o
                                 WHERE o.job_id = mine.job_id LIMIT mine.n + 1) AS o) = mine.n
    RETURNING j.id, j.state, j.queue
)
SELECT id, state, queue FROM promoted
UNION ALL
SELECT NULL, NULL, NULL WHERE (SELECT count(*) FROM mine) > (SELECT count(*) FROM promoted)
"""

# -- REVIVE_CASCADED --
# Before REOPEN_CASCADED: the dependents it will reopen that maintenance moved
# to awa_job_done (or its segments) come back into awa_job (see REVIVE_DONE),
# locked by the DELETE. Index: awa_dependency_dependents_idx, then the primary
# key of awa_job_done and of each segment.
REVIVE_CASCADED = """
WITH moved AS (
    DELETE FROM awa_job_done AS d
    USING awa_job_dependency AS e
    WHERE e.depends_on_id = ANY(%(ids)s::bigint[])
      AND d.id = e.job_id
      AND d.state = 'cancelled'
      AND jsonb_typeof(d.metadata -> 'awa_cancelled_by') = 'number'
      AND (d.metadata ->> 'awa_cancelled_by')::bigint = ANY(%(ids)s::bigint[])
    RETURNING d.*
)
INSERT INTO awa_job SELECT * FROM moved
"""

# -- DELETING_DEPENDENCIES --
# Before an ORM delete of jobs (JobQuerySet.delete, the admin's discard):
# those of them that others depend on, locked in id order as an outcome's
# write locks them (then their dependents), so no outcome is written for them
# meanwhile and no enqueue names them without seeing the delete. Returns each
# one's id and state. Primary key lookups of awa_job and awa_job_done.
DELETING_DEPENDENCIES = """
SELECT id, state FROM awa_job
WHERE id = ANY(%(ids)s::bigint[]) AND has_dependents
ORDER BY id
FOR UPDATE
"""

# -- MEET_BY_DELETION --
# In the deleting transaction, before the DELETE: the edges to the completed
# ones among the jobs being deleted go, as those dependencies were met: those
# of blocked jobs, and those of any other dependent too, which a retry (or the
# retry of the dependency that cancelled it) makes wait for its dependencies
# again. Every other edge to them stays and, its row gone, counts as a
# cancelled dependency for requires='completed' (the dependent is cancelled,
# CANCEL_BY_DEPENDENCY) and as a finished one for requires='finished'
# (PROMOTE_READY). Index: awa_dependency_dependents_idx.
MEET_BY_DELETION = """
DELETE FROM awa_job_dependency AS e
WHERE e.depends_on_id = ANY(%(completed)s::bigint[])
"""

# -- ORPHANED_BLOCKED --
# Maintenance, the safety net of deletion: of the next %(limit)s blocked jobs
# after %(after)s in id order, each one's id and whether one of its
# dependencies no longer exists (deleted by raw SQL, say, where no settling
# ran); those are settled then (dependencies.settle), and the next batch
# starts after the last id returned. No index holds the blocked jobs alone:
# the primary key from %(after)s, over awa_job's live rows (finished ones
# move to awa_job_done), which is why maintenance runs it once a minute, with
# prune. Each job's edges are read by the primary key of awa_job_dependency
# (job_id, ...) and each dependency looked up by primary key: the question
# is asked per job, never answered for the whole edge table at once. With
# the EXISTS in WHERE PostgreSQL made it a join, and in the select list a
# hashed subplan, each reading all 1,000,000 edges of benchmarks/workflows.py
# --plans; OFFSET 0 keeps it a subquery run per job.
ORPHANED_BLOCKED = """
SELECT b.id,
       EXISTS (SELECT 1 FROM awa_job_dependency AS e
               WHERE e.job_id = b.id
                 AND NOT EXISTS (SELECT 1 FROM awa_job AS d WHERE d.id = e.depends_on_id)
               OFFSET 0)
FROM ONLY awa_job AS b
WHERE b.state = 'blocked' AND b.id > %(after)s
ORDER BY b.id
LIMIT %(limit)s
"""

# -- STILL_BLOCKED --
# How many of these jobs are still blocked (after settling them). Primary key lookups.
STILL_BLOCKED = """
SELECT count(*) FROM ONLY awa_job WHERE id = ANY(%(ids)s::bigint[]) AND state = 'blocked'
"""

# -- REOPEN_CASCADED --
# A retried job's dependents that its failure or cancellation cancelled
# (metadata.awa_cancelled_by) are blocked again, attempts reset, to wait for
# it as before (REVIVE_CASCADED brought those in awa_job_done back first).
# Index: awa_dependency_dependents_idx.
# The dependents are found first (MATERIALIZED): the planner would otherwise
# walk every cancelled job.
REOPEN_CASCADED = f"""
WITH dependents AS MATERIALIZED (
    SELECT DISTINCT e.job_id FROM awa_job_dependency AS e
    WHERE e.depends_on_id = ANY(%(ids)s::bigint[])
)
UPDATE ONLY awa_job AS j
SET state = 'blocked', finalized_at = NULL, attempt = 0, snoozed = false,
    metadata = (j.metadata - 'awa_cancelled_by') || {_RETRIED_MARK}
FROM dependents
WHERE j.id = dependents.job_id
  AND j.state = 'cancelled'
  AND jsonb_typeof(j.metadata -> 'awa_cancelled_by') = 'number'
  AND (j.metadata ->> 'awa_cancelled_by')::bigint = ANY(%(ids)s::bigint[])
RETURNING j.id
"""

# -- BLOCK_DEPENDENTS_AGAIN --
# After REOPEN_CASCADED and BLOCK_AGAIN: the dependents of the reopened jobs
# (the retried ones and those reopened with them) that their finishing had
# released (requires='finished') and that have not started since are blocked
# again, to wait for them (then settled: released again at once if one is
# cancelled again). No attempt started: attempt 0 (never claimed, or retried
# since), or a claim given back before its handler began (attempted_at NULL).
# One that runs or ran stays as it is. The rows are taken in id order.
# Index: awa_dependency_dependents_idx, then primary key lookups.
BLOCK_DEPENDENTS_AGAIN = """
WITH dependents AS MATERIALIZED (
    SELECT DISTINCT e.job_id FROM awa_job_dependency AS e
    WHERE e.depends_on_id = ANY(%(ids)s::bigint[])
    ORDER BY e.job_id
)
UPDATE ONLY awa_job AS j
SET state = 'blocked'
FROM dependents
WHERE j.id = dependents.job_id
  AND j.state IN ('available', 'scheduled')
  AND (j.attempt = 0 OR j.attempted_at IS NULL)
RETURNING j.id
"""

# -- HAS_DEPENDENCIES --
# Which of these jobs have dependencies at all (a retried one waits for them
# again). Index: the primary key of awa_job_dependency.
HAS_DEPENDENCIES = """
SELECT DISTINCT job_id FROM awa_job_dependency WHERE job_id = ANY(%(ids)s::bigint[])
"""

# -- BLOCK_AGAIN --
# Retried jobs that have dependencies wait for them again: blocked, then settled.
BLOCK_AGAIN = """
UPDATE ONLY awa_job SET state = 'blocked' WHERE id = ANY(%(ids)s::bigint[]) AND state = 'available'
"""

# -- WORKFLOW_EDGES --
# Every edge among a workflow's jobs, for its graph. Index: awa_job_workflow_idx,
# then the primary key of awa_job_dependency (= ANY(ARRAY(...)), not IN: the
# planner hashed the workflow's ids and read every edge of the table).
WORKFLOW_EDGES = """
SELECT e.job_id, e.depends_on_id, e.requires, e.position
FROM awa_job_dependency AS e
WHERE e.job_id = ANY(ARRAY(SELECT id FROM awa_job WHERE workflow_id = %(workflow_id)s))
ORDER BY e.job_id, e.position
"""

# -- DEPENDENTS_OF --
# The blocked jobs depending on any of these jobs, no lock taken (the locks
# follow, in id order, in the mode each needs). Index:
# awa_dependency_dependents_idx, then primary key lookups.
DEPENDENTS_OF = """
SELECT j.id FROM ONLY awa_job AS j
WHERE j.id IN (SELECT e.job_id FROM awa_job_dependency AS e
               WHERE e.depends_on_id = ANY(%(ids)s::bigint[]))
  AND j.state = 'blocked'
ORDER BY j.id
"""

# -- DOOMED_BY --
# Of these blocked jobs, those a requires='completed' dependency among
# %(finished)s (this transaction's outcomes) cancels. Index: the primary key
# of awa_job_dependency.
DOOMED_BY = """
SELECT DISTINCT e.job_id FROM awa_job_dependency AS e
JOIN awa_job AS d ON d.id = e.depends_on_id
WHERE e.job_id = ANY(%(ids)s::bigint[]) AND e.depends_on_id = ANY(%(finished)s::bigint[])
  AND e.requires = 'completed' AND d.state IN ('failed', 'cancelled')
"""

# -- PENDING_OF --
# Of these blocked jobs, those with a dependency that is not finished and not
# running: not among %(mine)s (this transaction's outcomes), neither
# finished nor 'running' in this statement's snapshot. Such a dependency's
# outcome comes later, from a worker that runs it first, and settles the job
# then; this transaction needs only a KEY SHARE lock on the job, which other
# such transactions share (no convoy). A dependency whose outcome another
# transaction is writing right now was 'running' in every snapshot, so it
# never counts here: of two outcomes written at once, neither takes the other
# for pending (only worker outcomes use this; other paths lock FOR UPDATE).
# No lock taken. The newest dependencies first (ORDER BY ... DESC): in a
# fan-in they are the ones not yet claimed, so the scan stops at once. Index:
# the primary key of awa_job_dependency, backwards, then awa_job's alone (a
# row of awa_job_done is finished, never pending).
# Only the newest PENDING_SCAN dependencies are looked at: past them the job
# is taken for one this transaction may have to judge (FOR UPDATE), which is
# always correct, only less concurrent; so the last members of a fan-in of
# 10,000 do not each read the callback's 10,000 edges twice (here, then
# PROMOTE_READY, which stops at the first running one).
PENDING_SCAN = 200
_NEWEST_EDGES = f"""(SELECT e.depends_on_id FROM awa_job_dependency AS e
     WHERE e.job_id = {{job}} ORDER BY e.depends_on_id DESC LIMIT {PENDING_SCAN})"""
PENDING_OF = f"""
SELECT c.id FROM unnest(%(ids)s::bigint[]) AS c(id)
WHERE EXISTS (
    SELECT 1 FROM {_NEWEST_EDGES.format(job="c.id")} AS e
    JOIN ONLY awa_job AS d ON d.id = e.depends_on_id
    WHERE d.state NOT IN {_FINAL} AND d.state <> 'running'
      AND d.id <> ALL(%(mine)s::bigint[])
)
"""

# -- SHARE_BLOCKED --
# A KEY SHARE lock on blocked jobs that another outcome will settle: shared
# with other such transactions, and waited for by the one that judges the job
# (LOCK_BLOCKED's FOR UPDATE), so that one sees this transaction's outcome.
SHARE_BLOCKED = """
SELECT id FROM ONLY awa_job WHERE id = ANY(%(ids)s::bigint[]) AND state = 'blocked'
ORDER BY id
FOR KEY SHARE
"""

# -- DEPENDENTS_TO_JUDGE, DEPENDENTS_TO_JUDGE_COMPLETED --
# DEPENDENTS_OF, with for each dependent whether DOOMED_BY and PENDING_OF
# hold for it: the first round of finalize's locking in one statement. Same
# indexes. DEPENDENTS_TO_JUDGE_COMPLETED, when every one of these jobs
# completed: none can doom a dependent, and the DOOMED_BY lookup (each
# dependent's edges to these jobs, and their states: a fan-in callback's
# thousand per batch) is left out.
_DEPENDENTS_TO_JUDGE = f"""
SELECT j.id,
       {{doomed}},
       EXISTS (SELECT 1 FROM {_NEWEST_EDGES.format(job="j.id")} AS e
               JOIN ONLY awa_job AS d ON d.id = e.depends_on_id
               WHERE d.state NOT IN {_FINAL} AND d.state <> 'running'
                 AND d.id <> ALL(%(ids)s::bigint[]))
FROM ONLY awa_job AS j
WHERE j.id IN (SELECT e.job_id FROM awa_job_dependency AS e
               WHERE e.depends_on_id = ANY(%(ids)s::bigint[]))
  AND j.state = 'blocked'
ORDER BY j.id
"""
DEPENDENTS_TO_JUDGE = _DEPENDENTS_TO_JUDGE.format(
    doomed="""EXISTS (SELECT 1 FROM awa_job_dependency AS e
               JOIN awa_job AS d ON d.id = e.depends_on_id
               WHERE e.job_id = j.id AND e.depends_on_id = ANY(%(ids)s::bigint[])
                 AND e.requires = 'completed' AND d.state IN ('failed', 'cancelled'))"""
)
DEPENDENTS_TO_JUDGE_COMPLETED = _DEPENDENTS_TO_JUDGE.format(doomed="false")
