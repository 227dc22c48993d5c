"""Users for web tests: a staff member and a normal user, so "who may see this" is one line away."""

import pytest
from django.contrib.auth import get_user_model

PASSWORD = "correct horse battery staple"


@pytest.fixture
def alice(db):
    """A staff superuser."""
    return get_user_model().objects.create_superuser("alice", "alice@example.com", PASSWORD)


@pytest.fixture
def bob(db):
    """A normal user."""
    return get_user_model().objects.create_user("bob", "bob@example.com", PASSWORD)
