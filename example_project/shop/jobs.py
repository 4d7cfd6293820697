"""The shop's job kinds.

``ChargeCard`` talks to a pretend payment provider whose behaviour follows the
amount, so the demo shows every outcome:

* an amount ending in ``13`` is always declined: the charge raises on every
  attempt, exhausts its three attempts, and ``on_exhausted`` refunds the order;
* an amount ending in ``7`` is cancelled by the customer: the handler returns
  ``awa.Cancel`` and ``on_cancelled`` notifies them;
* any other attempt fails at random about one time in ten (a provider timeout)
  and is retried after the backoff;
* otherwise the order is paid, and ``on_completed`` sends a receipt and ships it.

The charge is ``atomic=True``: the order's new status commits in the same
transaction as the job's outcome and its follow-ups, so an order is ``paid``
exactly when its charge is ``completed`` and its receipt is enqueued.

``ShipOrder`` books the parcel with a carrier and parks on an external callback;
the carrier (``awa_demo`` plays it) answers with a tracking number.

Some orders are placed as a workflow instead (``order_workflow``):
charge, then ``PackOrder`` and ``InvoiceOrder`` in parallel, then ship, then an
``OrderReport`` that runs however the others ended (``requires="finished"``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from datetime import timedelta

import django_awa as awa

from .models import Notice, Order, OrderStatus, Receipt, Refund

PROVIDER_FAILURE_RATE = 0.10
DECLINED_SUFFIX = 13  # amount_cents % 100
CANCELLED_SUFFIX = 7  # amount_cents % 10
CARRIER_TIMEOUT = timedelta(minutes=5)


class ProviderTimeout(Exception):
    """The pretend payment provider did not answer; worth retrying."""


class CardDeclined(Exception):
    """The pretend payment provider declined the card; every attempt will."""


@dataclass
class ChargeCard(awa.JobArgs):
    order_id: int
    amount_cents: int


@dataclass
class SendReceipt(awa.JobArgs):
    order_id: int


@dataclass
class RefundOrder(awa.JobArgs):
    order_id: int


@dataclass
class NotifyCustomer(awa.JobArgs):
    order_id: int
    message: str


@dataclass
class ShipOrder(awa.JobArgs):
    order_id: int


@dataclass
class PackOrder(awa.JobArgs):
    order_id: int


@dataclass
class InvoiceOrder(awa.JobArgs):
    order_id: int


@dataclass
class OrderReport(awa.JobArgs):
    order_id: int


@dataclass
class ResizeImage(awa.JobArgs):
    image: str
    width: int


@dataclass
class SyncInventory(awa.JobArgs):
    sku: str


def is_declined(amount_cents: int) -> bool:
    return amount_cents % 100 == DECLINED_SUFFIX


def is_cancelled(amount_cents: int) -> bool:
    return amount_cents % 10 == CANCELLED_SUFFIX


def provider_latency() -> None:
    time.sleep(random.uniform(0.001, 0.004))  # noqa: S311 - a simulation, not crypto


@awa.worker(ChargeCard, queue="billing", max_attempts=3, atomic=True)
def charge_card(job: awa.JobContext):
    args: ChargeCard = job.args
    # Locked until the outcome commits. The status only leaves ``pending`` in the
    # transaction that finalizes this job, so another status means someone else
    # changed the order: charging it now would be wrong.
    order = Order.objects.select_for_update().get(id=args.order_id)
    if order.status != OrderStatus.PENDING:
        return awa.Cancel(f"order is already {order.status}")
    provider_latency()
    if is_declined(args.amount_cents):
        raise CardDeclined(f"card declined for order {order.reference}")
    if random.random() < PROVIDER_FAILURE_RATE:  # noqa: S311
        raise ProviderTimeout(f"payment provider timed out (attempt {job.attempt})")
    if is_cancelled(args.amount_cents):
        order.status = OrderStatus.CANCELLED
        order.save(update_fields=["status"])
        return awa.Cancel("customer cancelled")
    order.status = OrderStatus.PAID
    order.save(update_fields=["status"])
    return None


@awa.worker(SendReceipt, queue="email")
def send_receipt(job: awa.JobContext):
    order = Order.objects.get(id=job.args.order_id)
    # One INSERT ... ON CONFLICT DO NOTHING: a second run finds the receipt's
    # unique order and adds nothing (get_or_create costs a SELECT, and an
    # INSERT in a transaction of its own, on top).
    Receipt.objects.bulk_create(
        [Receipt(order=order, amount_cents=order.amount_cents)], ignore_conflicts=True
    )


@awa.worker(RefundOrder, queue="billing", priority=1, atomic=True)
def refund_order(job: awa.JobContext):
    order = Order.objects.select_for_update().get(id=job.args.order_id)
    Refund.objects.get_or_create(order=order, defaults={"amount_cents": order.amount_cents})
    order.status = OrderStatus.REFUNDED
    order.save(update_fields=["status"])


@awa.worker(NotifyCustomer, queue="email")
def notify_customer(job: awa.JobContext):
    # Once per order and message (shop_notice_once), in one statement.
    Notice.objects.bulk_create(
        [Notice(order_id=job.args.order_id, message=job.args.message[:200])],
        ignore_conflicts=True,
    )


@awa.worker(ShipOrder)
def ship_order(job: awa.JobContext):
    Order.objects.filter(id=job.args.order_id, status=OrderStatus.PAID).update(
        status=OrderStatus.SHIPPING
    )
    # The carrier gets the callback id and answers when the parcel is picked
    # up; a carrier silent for CARRIER_TIMEOUT gets the job rescued and retried.
    token = job.register_callback(timeout=CARRIER_TIMEOUT)
    return awa.WaitForCallback(token)


@awa.worker(PackOrder)
def pack_order(job: awa.JobContext):
    return {"parcel": f"PCL-{job.args.order_id}"}


@awa.worker(InvoiceOrder, queue="billing")
def invoice_order(job: awa.JobContext):
    order = Order.objects.get(id=job.args.order_id)
    return {"invoice": f"INV-{order.reference}", "amount_cents": order.amount_cents}


@awa.worker(OrderReport)
def order_report(job: awa.JobContext):
    # Runs once shipping finished in any state: the whole workflow's outcome.
    status = awa.workflow_status(job.workflow_id, using=job.row._state.db)
    order = Order.objects.get(id=job.args.order_id)
    steps = {j.kind: j.state for j in status.jobs if j.id != job.id}
    return {"order": order.reference, "status": order.status, "steps": steps}


def order_workflow(order: Order) -> awa.Workflow:
    """An order's jobs as one workflow, not yet enqueued: charge, then pack and invoice
    in parallel, then ship, then a report however shipping ended."""
    flow = awa.Workflow(f"order {order.reference}")
    charge = flow.add(ChargeCard(order_id=order.id, amount_cents=order.amount_cents))
    pack = flow.add(PackOrder(order_id=order.id), after=[charge])
    invoice = flow.add(InvoiceOrder(order_id=order.id), after=[charge])
    ship = flow.add(ShipOrder(order_id=order.id), after=[pack, invoice])
    flow.add(OrderReport(order_id=order.id), after=[ship], requires="finished")
    return flow


@awa.worker(ResizeImage)
def resize_image(job: awa.JobContext):
    time.sleep(0.001 * job.args.width / 400)


@awa.worker(SyncInventory, priority=3)
def sync_inventory(job: awa.JobContext):
    time.sleep(0.001)
