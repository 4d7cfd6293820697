"""How the shop's jobs chain. Each follow-up row is inserted in the transaction
that records its trigger's outcome, so a paid order always gets its receipt job,
and a declined one its refund job, even if the worker dies right after."""

from __future__ import annotations

import django_awa as awa
from django_awa.followups import on_cancelled, on_completed, on_exhausted

from .jobs import ChargeCard, NotifyCustomer, RefundOrder, SendReceipt, ShipOrder


@on_completed(ChargeCard)
def receipt_for_charge(args: ChargeCard, job) -> SendReceipt:
    return SendReceipt(order_id=args.order_id)


@on_completed(ChargeCard)
def ship_paid_order(args: ChargeCard, job) -> ShipOrder | None:
    # An order placed as a workflow ships as its own step, after packing and invoicing.
    if job.workflow_id is not None:
        return None
    return ShipOrder(order_id=args.order_id)


@on_exhausted(ChargeCard)
def refund_declined_charge(args: ChargeCard, job, error: str, attempt: int):
    return awa.EnqueueRequest(RefundOrder(order_id=args.order_id), queue="billing", priority=1)


@on_cancelled(ChargeCard)
def tell_customer_cancelled(args: ChargeCard, job, reason: str) -> NotifyCustomer:
    return NotifyCustomer(order_id=args.order_id, message=reason)


@on_completed(ShipOrder)
def tell_customer_shipped(args: ShipOrder, job) -> NotifyCustomer:
    tracking = (job.metadata.get("awa_callback_result") or {}).get("tracking")
    message = f"shipped, tracking {tracking}" if tracking else "shipped"
    return NotifyCustomer(order_id=args.order_id, message=message)
