"""`python manage.py createtoken USER [--name NAME]`: issue a personal API token; the token is the last line."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from webapp.accounts.models import ApiToken


class Command(BaseCommand):
    help = "Create a personal API token for USER (Authorization: Bearer TOKEN); prints the token as the last line."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="script", help="a label to tell tokens apart (default: script)")

    def handle(self, *args, username, name, **options):
        most = ApiToken._meta.get_field("name").max_length
        if not name.strip() or len(name) > most:
            raise CommandError(f"--name must be 1 to {most} characters, got {len(name)}")
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}; create one first (manage.py createsuperuser or the admin)")
        _, token = ApiToken.issue(user, name)
        self.stdout.write(f"API token {name!r} for {username} (shown once; revoke it on the profile page):")
        self.stdout.write(token)
