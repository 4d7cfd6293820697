"""``ModelAdmin[M]`` and ``bad_request`` for every admin module of the app.

django-stubs makes ``ModelAdmin`` generic, which is how ``ModelAdmin[Job]`` types
an admin's querysets and objects; Django's own class takes no subscript, so at
run time the subscript returns the class itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.http import HttpResponseBadRequest

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
else:

    class ModelAdmin(admin.ModelAdmin):
        def __class_getitem__(cls, params):
            return cls


def bad_request(message: str) -> HttpResponseBadRequest:
    """A 400 whose body is ``message`` as plain text.

    Messages quote what the request sent (a parameter's name or value, a form
    field); Django's default ``text/html`` would let a link run a script it
    put in them in the admin's origin, so the body is never HTML.
    """
    return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")


__all__ = ["ModelAdmin", "bad_request"]
