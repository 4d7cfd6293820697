from django.contrib import admin

from .models import Notice, Order, Receipt, Refund


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("reference", "amount_cents", "status", "created_at")
    list_filter = ("status",)
    search_fields = ("reference",)


@admin.register(Receipt, Refund)
class MoneyAdmin(admin.ModelAdmin):
    list_display = ("order", "amount_cents")
    raw_id_fields = ("order",)


@admin.register(Notice)
class NoticeAdmin(admin.ModelAdmin):
    list_display = ("order", "message", "created_at")
    raw_id_fields = ("order",)
