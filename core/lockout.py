"""django-axes' database handler with a limit of its own for the username alone.

Axes locks on any entry of AXES_LOCKOUT_PARAMETERS, here `[["username", "ip_address"],
"username"]`, but compares every entry with the one AXES_FAILURE_LIMIT. A username is locked
from everywhere once it is, so its limit must be higher than the pair's, or one address's typos
would lock the user out of every other: it is LOGIN_USERNAME_FAILURE_LIMIT. The pair's limit
stops one client early; the username's stops a client that shows a new address on every guess
(a forged X-Forwarded-For where no proxy stands in front, or many machines), which the pair's
limit never sees twice.
"""

from axes.handlers.database import AxesDatabaseHandler
from axes.helpers import get_lockout_parameters
from django.conf import settings
from django.db.models import Sum


class UsernameAndAddressLockoutHandler(AxesDatabaseHandler):
    def get_failures(self, request, credentials=None) -> int:
        # Axes compares this one number with AXES_FAILURE_LIMIT (the pair's limit). The
        # username's count, lowered by the difference of the two limits, reaches it exactly
        # when the username reaches its own limit.
        username_offset = settings.LOGIN_USERNAME_FAILURE_LIMIT - settings.AXES_FAILURE_LIMIT
        counts = []
        for parameter, attempts in zip(
            get_lockout_parameters(request, credentials),
            self.get_user_attempts(request, credentials),
            strict=True,
        ):
            failures = attempts.aggregate(total=Sum("failures_since_start"))["total"] or 0
            counts.append(failures - username_offset if parameter == "username" else failures)
        return max(counts, default=0)
