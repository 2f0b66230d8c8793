"""`manage.py create_account NAME [--password P] [--staff]`: makes or finds an account and prints
its API token last; a password that fails AUTH_PASSWORD_VALIDATORS changes nothing (exit 1)."""
from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Make an account (or find it) and print its API token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--password", help="set this password (for the drawing page and the admin)")
        parser.add_argument("--staff", action="store_true", help="make the account staff (admin access)")

    def handle(self, *args: Any, name: str, password: str | None, staff: bool, **options: Any) -> None:
        if not name.strip() or len(name) > 150:
            raise CommandError("NAME must be 1 to 150 characters")
        with transaction.atomic():
            account, created = get_user_model().objects.get_or_create(username=name)
            if password:
                try:
                    validate_password(password, user=account)
                except ValidationError as exc:  # rolls the new account back with the transaction
                    raise CommandError(f"password refused: {' '.join(exc.messages)}") from None
                account.set_password(password)
            elif created:
                account.set_unusable_password()
            if staff:
                account.is_staff = account.is_superuser = True
            account.save()
            token, _ = Token.objects.get_or_create(user=account)
        self.stdout.write(f"{'created' if created else 'found'} account {name}{' (staff)' if account.is_staff else ''}")
        self.stdout.write(token.key)
