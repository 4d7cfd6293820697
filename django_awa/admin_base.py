"""``ModelAdmin[M]`` for every admin module of the app.

django-stubs makes ``ModelAdmin`` generic, which is how ``ModelAdmin[Job]`` types
an admin's querysets and objects; Django's own class takes no subscript, so at
run time the subscript returns the class itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
else:

    class ModelAdmin(admin.ModelAdmin):
        def __class_getitem__(cls, params):
            return cls


__all__ = ["ModelAdmin"]
