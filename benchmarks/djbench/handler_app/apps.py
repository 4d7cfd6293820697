from django.apps import AppConfig


class HandlerAppConfig(AppConfig):
    name = "djbench.handler_app"
    label = "bench_handler_app"
    default_auto_field = "django.db.models.BigAutoField"
