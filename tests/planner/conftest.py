import pytest

from accounts.services import planner_create
from tests.support.browser import PLANNER_PASSWORD, chromium, collected_static, page, site

__all__ = ["chromium", "collected_static", "page", "site"]


@pytest.fixture
def planner_user(db):
    user, _ = planner_create(username="pat", password=PLANNER_PASSWORD, email="pat@example.com")
    return user
