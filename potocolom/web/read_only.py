"""Admin pages that show and never write: jobs, workers, sessions and placement records change only
through their services (the pages' actions call them), never a Save button or a delete.
docs/operations.md, "The admin"."""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest


class ReadOnlyAdmin(admin.ModelAdmin):
    """No add, no Save, no delete: Django shows the change page as a view (no Save button) and
    refuses a POST to it (403). The actions a subclass declares stay."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
