"""Workflows: jobs enqueued together as a graph of dependencies (SPEC §11).

``Workflow.add`` collects steps; ``Workflow.enqueue`` validates the whole
graph before writing anything (a cycle, a step of another workflow, an
unknown step name or job id, a job of another database, a bad item or
``requires``: ``ValidationError`` naming it) and inserts every step in the
caller's transaction, through the one insert path for jobs with
dependencies (``dependencies.insert_with_dependencies``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction

from . import db, sql
from .dependencies import insert_with_dependencies
from .enqueueing import (
    EnqueueRequest,
    PreparedJob,
    check_requires,
    database_alias,
    dependency_ids,
    prepare,
    unique_conflict,
)
from .exceptions import UniqueConflict, ValidationError
from .kinds import JobArgs
from .models import Job, JobState

# The longest workflow name kept (metadata["awa_workflow"]["name"]).
MAX_NAME = 255


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """A step of a ``Workflow``, as ``Workflow.add`` returns it: pass it to a later
    step's ``after``. ``job`` is its row once the workflow is enqueued."""

    workflow: Workflow
    index: int
    item: JobArgs | EnqueueRequest
    after: tuple[Any, ...]
    requires: str
    name: str | None

    @property
    def job(self) -> Job | None:
        jobs = self.workflow.jobs
        return jobs[self.index] if jobs is not None else None

    def __repr__(self) -> str:
        item = self.item.args if isinstance(self.item, EnqueueRequest) else self.item
        label = self.name or getattr(item, "kind", None) or type(item).__name__
        return f"<Step {self.index} {label!r} of {self.workflow!r}>"


class Workflow:
    """Jobs that depend on one another, enqueued together.

    ``with transaction.atomic(): flow = awa.Workflow("order-42"); a = flow.add(X());
    flow.add(Y(), after=[a]); flow.enqueue()``. Every step shares ``workflow_id``.
    """

    def __init__(self, name: str | None = None) -> None:
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME):
            raise ValidationError(
                f"Workflow name must be a string of at most {MAX_NAME} characters, got {name!r}"
            )
        self.name = name
        self.id = uuid.uuid4()
        self.steps: list[Step] = []
        self.jobs: list[Job] | None = None

    def __repr__(self) -> str:
        steps = len(self.steps)
        return f"<Workflow {self.name or self.id} ({steps} step{'s' if steps != 1 else ''})>"

    def add(
        self,
        args_or_request: JobArgs | EnqueueRequest,
        *,
        after: Sequence[Any] = (),
        requires: str = "completed",
        name: str | None = None,
    ) -> Step:
        """Add a step; returns it, for later steps' ``after``.

        ``after`` takes steps of this workflow, step names (a later step's
        too), or ``Job`` rows / ids of jobs already enqueued. Checked in full
        by ``enqueue``.
        """
        if self.jobs is not None:
            raise ValidationError(f"{self!r} is already enqueued: add steps to a new Workflow")
        if isinstance(after, (str, bytes)) or not isinstance(after, Sequence | set | frozenset):
            raise ValidationError(f"Workflow.add: after must be a list, got {after!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValidationError(f"Workflow.add: name must be a non-empty string, got {name!r}")
        if name is not None and any(step.name == name for step in self.steps):
            raise ValidationError(f"Workflow.add: a step named {name!r} is already in {self!r}")
        step = Step(
            workflow=self,
            index=len(self.steps),
            item=args_or_request,
            after=tuple(after),
            requires=requires,
            name=name,
        )
        self.steps.append(step)
        return step

    def enqueue(self, *, using: str | None = None) -> list[Job]:
        """Validate the whole graph, insert every step in the caller's transaction on
        ``using``; return the ``Job`` rows in ``add()`` order.

        Raises ``ValidationError`` (a cycle, a bad reference or item; nothing
        written) or ``UniqueConflict`` (a step's unique key is held; nothing
        written, the caller's transaction stays usable).
        """
        return Workflow.enqueue_many([self], using=using)[0]

    async def aenqueue(self, *, using: str | None = None) -> list[Job]:
        """``enqueue`` for async code: runs in the thread that holds the async caller's
        Django connection (``sync_to_async(thread_sensitive=True)``), so it joins a
        transaction opened there."""
        return await sync_to_async(self.enqueue, thread_sensitive=True)(using=using)

    @staticmethod
    def enqueue_many(workflows: Iterable[Workflow], *, using: str | None = None) -> list[list[Job]]:
        """Enqueue several workflows at once, in the caller's transaction on ``using``.

        The same as calling ``enqueue`` on each, in one savepoint and a handful
        of statements whatever their number: ids for every step drawn in one
        statement, the steps in one ``INSERT``, the edges in another, the new
        blocked steps judged together. Returns each workflow's ``Job`` rows in
        ``add()`` order, in the order the workflows were given.

        Every workflow is validated before anything is written: an item that is
        not a ``Workflow``, one given twice, already enqueued or without steps,
        or any of the errors ``enqueue`` names raise ``ValidationError`` with
        nothing written. A step's unique key already held raises
        ``UniqueConflict`` naming the step; none of the workflows is written
        and the caller's transaction stays usable.
        """
        if isinstance(workflows, (str, bytes, Workflow)) or not isinstance(workflows, Iterable):
            raise ValidationError(
                f"Workflow.enqueue_many takes a list of workflows, got {workflows!r}"
            )
        flows = list(workflows)
        seen: set[int] = set()
        for flow in flows:
            if not isinstance(flow, Workflow):
                raise ValidationError(
                    f"Workflow.enqueue_many takes Workflow objects, got "
                    f"{type(flow).__name__}: {flow!r}; nothing was enqueued"
                )
            if id(flow) in seen:
                raise ValidationError(f"{flow!r} is given twice; nothing was enqueued")
            seen.add(id(flow))
            if flow.jobs is not None:
                raise ValidationError(f"{flow!r} is already enqueued")
            if not flow.steps:
                raise ValidationError(f"{flow!r} has no steps")
        if not flows:
            return []
        alias = database_alias(using)
        graphs = [flow._prepare(alias) for flow in flows]
        prepared = [job for graph in graphs for job in graph]
        # The ids of every new step, drawn in one statement.
        drawn = _reserve(alias, len(prepared))
        _check_not_drawn(flows, graphs, set(drawn))
        ids = iter(drawn)
        for flow, graph in zip(flows, graphs, strict=True):
            flow._number(graph, [next(ids) for _ in graph])
        with transaction.atomic(using=alias):
            inserted = insert_with_dependencies(
                prepared,
                alias,
                ids=True,
                where=lambda n: "{!r}: {!r}: ".format(*_step_at(flows, n)),
            )
            if inserted.skipped:
                flow, step = _step_at(flows, inserted.skipped[0])
                others = len(flows) - 1
                then = (
                    f"; nothing of {flow!r}"
                    + (
                        f" nor of the {others} other workflow{'s' if others > 1 else ''}"
                        if others
                        else ""
                    )
                    + " was enqueued"
                )
                # Leaving the block by raising rolls back every workflow.
                twin = _twin(flows, prepared, inserted.skipped[0], set(inserted.ids))
                if twin is not None:
                    # The holder is a step enqueued with it: no job holds the
                    # key once this rolls back, so none is named.
                    raise UniqueConflict(
                        f"{step!r}: a job of kind {prepared[inserted.skipped[0]].kind!r} "
                        f"has the same unique key as {twin!r}, enqueued with it" + then
                    )
                raise unique_conflict(
                    prepared[inserted.skipped[0]], alias, where=f"{step!r}: ", then=then
                )
        rows = {job.id: job for job in Job.objects.using(alias).filter(id__in=inserted.ids)}
        position = 0
        for flow in flows:
            flow.jobs = [
                rows[job_id] for job_id in inserted.ids[position : position + len(flow.steps)]
            ]
            position += len(flow.steps)
        return [flow.jobs for flow in flows if flow.jobs is not None]

    @staticmethod
    async def aenqueue_many(
        workflows: Iterable[Workflow], *, using: str | None = None
    ) -> list[list[Job]]:
        """``enqueue_many`` for async code, on the connection ``aenqueue`` uses."""
        return await sync_to_async(Workflow.enqueue_many, thread_sensitive=True)(
            list(workflows), using=using
        )

    def _prepare(self, alias: str) -> list[PreparedJob]:
        """Every step validated, the graph checked acyclic; ids drawn later (``_number``)."""
        by_name = {step.name: step for step in self.steps if step.name is not None}
        edges: dict[int, list[int]] = {}
        prepared: list[PreparedJob] = []
        metadata = {"awa_workflow": {"id": str(self.id), "name": self.name}}
        for step in self.steps:
            where = f"{step!r}"
            try:
                requires = check_requires(step.requires, where)
                item = step.item
                if isinstance(item, EnqueueRequest) and item.after:
                    raise ValidationError(
                        f"{where}: give a step's dependencies to Workflow.add(after=...), "
                        f"not to its EnqueueRequest"
                    )
                job = prepare(item, metadata_json=_metadata_json(metadata, step))
            except ValidationError as exc:
                raise ValidationError(f"{self!r}: {exc}") from exc
            steps_before: list[int] = []
            existing: list[Any] = []
            for ref in step.after:
                if isinstance(ref, Step):
                    if ref.workflow is not self:
                        raise ValidationError(
                            f"{self!r}: {where} names {ref!r}, a step of another workflow"
                        )
                    steps_before.append(ref.index)
                elif isinstance(ref, str):
                    if ref not in by_name:
                        raise ValidationError(
                            f"{self!r}: {where} names a step {ref!r}, which is not in this workflow"
                        )
                    steps_before.append(by_name[ref].index)
                else:
                    existing.append(ref)
            if step.index in steps_before:
                raise ValidationError(f"{self!r}: {where} names itself in after")
            job.requires = requires
            job.workflow_id = self.id
            job.after = dependency_ids(existing, f"{self!r}: {where}", alias=alias)
            edges[step.index] = list(dict.fromkeys(steps_before))
            prepared.append(job)
        _check_acyclic(self, edges)
        _check_sequences(self, edges, [job.sequence_key for job in prepared])
        return prepared

    def _number(self, prepared: list[PreparedJob], ids: list[int]) -> None:
        """Give each prepared step its drawn id; each step's ``after`` lists its
        dependencies in the order given: earlier steps, then jobs."""
        by_name = {step.name: step for step in self.steps if step.name is not None}
        for step, job in zip(self.steps, prepared, strict=True):
            job.id = ids[step.index]
            order = []
            for ref in step.after:
                if isinstance(ref, Step):
                    order.append(ids[ref.index])
                elif isinstance(ref, str):
                    order.append(ids[by_name[ref].index])
                else:
                    order.append(ref.id if isinstance(ref, Job) else ref)
            job.after = list(dict.fromkeys(order))


def _check_not_drawn(
    flows: list[Workflow], graphs: list[list[PreparedJob]], drawn: set[int]
) -> None:
    """``ValidationError`` if a step's ``after`` gives as a job id one of the ids just
    drawn for the new steps: it named no job when it was written (an id of another
    database, say), and taken for the step that drew it, it would be an edge no one
    asked for, a cycle even, with both steps blocked for ever."""
    for flow, graph in zip(flows, graphs, strict=True):
        for step, job in zip(flow.steps, graph, strict=True):
            clash = next((i for i in job.after if i in drawn), None)
            if clash is not None:
                raise ValidationError(
                    f"{flow!r}: {step!r}: after names job id {clash}, which does not exist; "
                    f"nothing was enqueued"
                )


def _twin(
    flows: list[Workflow], prepared: list[PreparedJob], position: int, inserted: set[int]
) -> Step | None:
    """The step inserted in the same statement as the step at ``position`` (which was
    skipped) with the same unique key, if any."""
    key = prepared[position].unique_key
    if key is None:
        return None
    for index, job in enumerate(prepared):
        if index != position and job.id in inserted and job.unique_key == key:
            return _step_at(flows, index)[1]
    return None


def _step_at(flows: list[Workflow], position: int) -> tuple[Workflow, Step]:
    """The workflow and step at ``position`` of the steps of ``flows``, concatenated."""
    for flow in flows:
        if position < len(flow.steps):
            return flow, flow.steps[position]
        position -= len(flow.steps)
    raise IndexError(position)


def _metadata_json(metadata: dict[str, Any], step: Step) -> str:
    entry = dict(metadata["awa_workflow"])
    if step.name is not None:
        entry["step"] = step.name
    return json.dumps({"awa_workflow": entry})


def _reserve(alias: str, n: int) -> list[int]:
    with db.cursor(alias) as cursor:
        cursor.execute(sql.RESERVE_IDS, {"n": n})
        return [row[0] for row in cursor.fetchall()]


def _check_acyclic(workflow: Workflow, edges: dict[int, list[int]]) -> None:
    """``ValidationError`` naming the steps of a cycle, if the steps' graph has one."""
    remaining = {index: set(deps) for index, deps in edges.items()}
    ready = [index for index, deps in remaining.items() if not deps]
    dependents: dict[int, list[int]] = {}
    for index, deps in edges.items():
        for dep in deps:
            dependents.setdefault(dep, []).append(index)
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for dependent in dependents.get(index, ()):
            remaining[dependent].discard(index)
            if not remaining[dependent]:
                ready.append(dependent)
    if done == len(edges):
        return
    stuck = {index for index, deps in remaining.items() if deps}
    # Walk back along dependencies inside what is stuck until a step repeats.
    start = min(stuck)
    path = [start]
    while True:
        following = min(dep for dep in remaining[path[-1]] if dep in stuck)
        if following in path:
            cycle = [*path[path.index(following) :], following]
            break
        path.append(following)
    names = " -> ".join(repr(workflow.steps[i]) for i in reversed(cycle))
    raise ValidationError(f"{workflow!r} has a cycle: {names}; nothing was enqueued")


def _check_sequences(
    workflow: Workflow, edges: dict[int, list[int]], keys: list[str | None]
) -> None:
    """``ValidationError`` if a step waits, directly or not, for a later step of its
    own sequence: that step cannot start before this one finishes (SPEC §12), so
    neither would ever run. The steps are in add() order, their sequences' order.
    """
    shared = {key for key in keys if key is not None and keys.count(key) > 1}
    if not shared:
        return
    # For each step, the latest step of each shared sequence among those it waits
    # for, through every path: steps taken in an order where dependencies come first.
    latest: dict[int, dict[str, int]] = {}
    pending = {index: set(deps) for index, deps in edges.items()}
    dependents: dict[int, list[int]] = {}
    for index, deps in edges.items():
        for dep in deps:
            dependents.setdefault(dep, []).append(index)
    ready = [index for index, deps in pending.items() if not deps]
    while ready:  # bounded: each step is taken once (the graph has no cycle)
        index = ready.pop()
        mine: dict[str, int] = {}
        for dep in edges[index]:
            for seen, step in latest[dep].items():
                mine[seen] = max(mine.get(seen, -1), step)
            dep_key = keys[dep]
            if dep_key is not None and dep_key in shared:
                mine[dep_key] = max(mine.get(dep_key, -1), dep)
        latest[index] = mine
        own = keys[index]
        if own is not None and mine.get(own, -1) > index:
            later = workflow.steps[mine[own]]
            raise ValidationError(
                f"{workflow!r}: {workflow.steps[index]!r} waits for {later!r}, which comes "
                f"after it in sequence {own!r} and cannot start before it finishes; "
                f"nothing was enqueued"
            )
        for dependent in dependents.get(index, ()):
            pending[dependent].discard(index)
            if not pending[dependent]:
                ready.append(dependent)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowStatus:
    """What ``awa.workflow_status`` reports: counts per state and the jobs, by id."""

    workflow_id: uuid.UUID
    name: str | None
    counts: dict[str, int]
    jobs: list[Job] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Every job is completed, failed or cancelled."""
        return bool(self.jobs) and all(job.state in JobState.FINAL for job in self.jobs)

    @property
    def state(self) -> str:
        """``completed`` when every job completed; ``failed`` or ``cancelled`` when it ended
        with one of those; ``unknown`` when no job of it is kept (an id never enqueued
        here, or a workflow whose jobs were all pruned past their retention); else
        ``running`` (``blocked`` jobs and others still live)."""
        if not self.jobs:
            return "unknown"
        if not self.finished:
            return "running"
        for state in (JobState.FAILED, JobState.CANCELLED):
            if self.counts.get(state):
                return str(state)
        return str(JobState.COMPLETED)


def workflow_status(workflow_id: uuid.UUID | str, *, using: str | None = None) -> WorkflowStatus:
    """The jobs of workflow ``workflow_id`` (every state, by id) and their counts per
    state. Raises ``ValidationError`` for an id that is not a UUID; an unknown one
    reports no jobs."""
    alias = database_alias(using)
    try:
        wid = workflow_id if isinstance(workflow_id, uuid.UUID) else uuid.UUID(str(workflow_id))
    except ValueError:
        raise ValidationError(f"workflow_status: {workflow_id!r} is not a workflow id") from None
    jobs = list(Job.objects.using(alias).filter(workflow_id=wid).order_by("id"))
    counts = {state: 0 for state in JobState.values}
    for job in jobs:
        counts[job.state] = counts.get(job.state, 0) + 1
    name = None
    for job in jobs:
        entry = (job.metadata or {}).get("awa_workflow")
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            name = entry["name"]
            break
    return WorkflowStatus(workflow_id=wid, name=name, counts=counts, jobs=jobs)
