"""`python manage.py invite [--staff]`: a one-time link for a new user to choose a username and password."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from webapp.accounts.models import INVITE_DAYS, Invitation
from webapp.accounts.users import invitation_link


class Command(BaseCommand):
    help = f"Print a one-time invitation link (valid {INVITE_DAYS} days) for a new user; the link is the last line."

    def add_arguments(self, parser):
        parser.add_argument("--staff", action="store_true", help="the new user adds devices and acts on every job")

    def handle(self, *args, staff, **options):
        by = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        _, token = Invitation.issue(by, staff)
        role = "staff" if staff else "a user"
        self.stdout.write(f"Invitation for {role}, valid {INVITE_DAYS} days, works once (shown once):")
        self.stdout.write(invitation_link(token))
