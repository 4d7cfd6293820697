"""Async views that enqueue with ``awa.aenqueue`` (driven by Django's AsyncClient)."""

from __future__ import annotations

from asgiref.sync import async_to_sync, sync_to_async
from django.db import transaction
from django.http import HttpRequest, JsonResponse

import django_awa as awa

from .jobs import Echo
from .models import Order


async def enqueue_view(request: HttpRequest) -> JsonResponse:
    """An ORM write and a job, from async code, in autocommit."""
    reference = request.GET["reference"]
    order = await Order.objects.acreate(reference=reference)
    job = await awa.aenqueue(Echo(n=order.id, note=f"order:{reference}"), queue="echo")
    more = [Echo(n=order.id, note=f"bulk:{reference}:{i}") for i in range(2)]
    ids = await awa.aenqueue_many(more)
    return JsonResponse({"job": job.id, "many": ids, "order": order.id})


async def checkout_view(request: HttpRequest) -> JsonResponse:
    """The view's transaction: a sync ``atomic()`` block (Django's way in async views)
    that runs async code awaiting ``aenqueue``; ``?fail=1`` rolls it back."""
    reference = request.GET["reference"]

    async def notify(order_id: int) -> int:
        job = await awa.aenqueue(Echo(n=order_id, note=f"checkout:{reference}"))
        return job.id

    def place() -> dict[str, int]:
        with transaction.atomic():
            order = Order.objects.create(reference=reference)
            job_id = async_to_sync(notify)(order.id)
            if request.GET.get("fail"):
                raise RuntimeError("payment declined: the transaction rolls back")
            return {"order": order.id, "job": job_id}

    return JsonResponse(await sync_to_async(place)())
