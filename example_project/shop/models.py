"""The shop's rows. Jobs write them; handlers are idempotent, since delivery is at
least once: a receipt, refund or notice is keyed so that a second run of the
same job finds the first run's row instead of adding another."""

from __future__ import annotations

from django.db import models


class OrderStatus(models.TextChoices):
    PENDING = "pending"
    PAID = "paid"
    SHIPPING = "shipping"
    REFUNDED = "refunded"
    CANCELLED = "cancelled"


class Order(models.Model):
    reference = models.CharField(max_length=32, unique=True)
    amount_cents = models.PositiveIntegerField()
    status = models.CharField(
        max_length=16, choices=OrderStatus.choices, default=OrderStatus.PENDING
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("-id",)

    def __str__(self) -> str:
        return f"{self.reference} ({self.status})"


class Receipt(models.Model):
    """Written by ``SendReceipt``, the follow-up of a completed charge."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="receipt")
    amount_cents = models.PositiveIntegerField()
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"receipt for {self.order_id}"


class Refund(models.Model):
    """Written by ``RefundOrder``, the follow-up of an exhausted charge."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="refund")
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"refund for {self.order_id}"


class Notice(models.Model):
    """A message to the customer, written by ``NotifyCustomer``."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="notices")
    message = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = (
            models.UniqueConstraint(fields=("order", "message"), name="shop_notice_once"),
        )

    def __str__(self) -> str:
        return f"notice for {self.order_id}: {self.message}"
