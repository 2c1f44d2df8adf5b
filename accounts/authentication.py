"""`Authorization: Bearer <prefix.secret>` for provisioning systems, gateways and scripts."""

from datetime import timedelta

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from accounts import keys
from accounts.models import ApiKey
from core.audit import note_api_key

# last_used_at is a hint for people auditing keys; writing it on every request would turn every
# read into a write, so it moves at most once per interval.
LAST_USED_RESOLUTION = timedelta(seconds=60)


class ApiKeyUser:
    """What `request.user` is for a request authenticated by an API key."""

    is_authenticated = True
    is_active = True
    is_anonymous = False
    is_staff = False
    is_superuser = False
    pk = None
    id = None

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key
        self.username = f"api-key:{api_key.prefix}"

    def __str__(self) -> str:
        return self.username


class BearerApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed(
                "Malformed Authorization header: expected 'Bearer <prefix.secret>'."
            )
        try:
            plaintext = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed(
                "The API key holds non-ASCII characters."
            ) from None
        parts = keys.split(plaintext)
        if parts is None:
            raise exceptions.AuthenticationFailed("Malformed API key: expected 'prefix.secret'.")
        prefix, secret = parts
        api_key = ApiKey.objects.select_related("customer").filter(prefix=prefix).first()
        if api_key is None or not keys.secret_matches(secret, api_key.secret_sha256):
            raise exceptions.AuthenticationFailed("Invalid API key.")
        now = timezone.now()
        if api_key.revoked_at is not None:
            raise exceptions.AuthenticationFailed("This API key has been revoked.")
        if api_key.expires_at is not None and api_key.expires_at <= now:
            raise exceptions.AuthenticationFailed("This API key has expired.")
        self._touch(api_key, now)
        note_api_key(request, api_key)
        return ApiKeyUser(api_key), api_key

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'

    @staticmethod
    def _touch(api_key: ApiKey, now) -> None:
        stale_before = now - LAST_USED_RESOLUTION
        if api_key.last_used_at is None or api_key.last_used_at < stale_before:
            ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
            api_key.last_used_at = now


class BearerApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.BearerApiKeyAuthentication"
    name = "BearerApiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "prefix.secret",
            "description": "An API key, shown once when created.",
        }
