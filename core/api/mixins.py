"""What several of the API's ViewSets share."""

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer


class AuditedPatchMixin(mixins.UpdateModelMixin):
    """Changes by PATCH only, through the app's audited update service.

    A PATCH body is checked by `change_serializer_class` (a StrictSerializer naming the fields
    that may change: any other is refused, naming it), its fields are handed to
    `perform_audited_update`, which calls the service that writes the change and its audit
    entry, and the answer is the changed object in `serializer_class`. PUT is not offered (a
    change names only what changes); reached another way, `update` refuses it with
    `put_refused_message`. The schema documents the PATCH as taking the change serializer and
    answering the object's.
    """

    change_serializer_class: type[BaseSerializer]
    put_refused_message: str
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        change = cls.__dict__.get("change_serializer_class")
        if change is not None:
            # Each ViewSet's own PATCH in the schema (extend_schema_view keeps it off the mixin).
            extend_schema_view(
                partial_update=extend_schema(request=change, responses=cls.serializer_class)
            )(cls)

    def perform_audited_update(self, instance, *, changes: dict):
        """Write `changes` to `instance` through the app's service (with its audit entry) and
        return the changed object."""
        raise NotImplementedError

    # No docstring: the schema would show it as the PATCH's description.
    def partial_update(self, request, *args, **kwargs):
        instance = self.get_object()
        serializer = self.change_serializer_class(data=request.data)
        serializer.is_valid(raise_exception=True)
        changed = self.perform_audited_update(instance, changes=dict(serializer.validated_data))
        return Response(self.serializer_class(changed).data)

    def update(self, request, *args, **kwargs):
        if not kwargs.get("partial"):
            raise PermissionDenied(self.put_refused_message)
        return super().update(request, *args, **kwargs)
