from django.contrib import admin

from accounts.hooks import keys_changed
from accounts.models import DEFAULT_TIER, ApiKey, Customer, Membership, Tier
from accounts.selectors import live_api_keys_made_by
from accounts.services import api_key_revoke, membership_remove
from core.audit import AuditedAdminMixin, actor_of


class KeysChangedAdminMixin:
    """Gateways hold a copy of the keys and the customers' slugs (accounts.hooks): a change
    saved in the admin reaches them as soon as it commits, as the services' writes do."""

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)  # type: ignore[misc]
        keys_changed()

    def delete_model(self, request, obj):
        super().delete_model(request, obj)  # type: ignore[misc]
        keys_changed()


class MembershipInline(admin.TabularInline):
    """People are added here; they are removed on the Memberships page (or the planner's
    customer page), which offers to revoke the keys they made."""

    model = Membership
    extra = 0
    autocomplete_fields = ["user"]
    can_delete = False


@admin.register(Tier)
class TierAdmin(KeysChangedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """Planners define tiers here (the planners group holds the tier permissions), in the
    planner UI (/planner/tiers/) or through /api/v1/tiers/. Customers refer to a tier by name,
    so a tier's name is fixed once created; a change of weight reaches the next allocation
    tick, a change of shed order the next degradation step, and gateways get the customers'
    tiers at once."""

    list_display = ["name", "label", "weight", "shed_order"]
    ordering = ["shed_order"]

    def get_readonly_fields(self, request, obj=None):
        return ["name"] if obj is not None else []

    def has_delete_permission(self, request, obj=None) -> bool:
        # New customers go to the default tier: it stays (accounts.services.tier_delete).
        if obj is not None and obj.name == DEFAULT_TIER:
            return False
        return super().has_delete_permission(request, obj)


@admin.register(Customer)
class CustomerAdmin(KeysChangedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    list_display = ["slug", "name", "tier", "created_at"]
    list_filter = ["tier"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(AuditedAdminMixin, admin.ModelAdmin):
    """Deleting a membership removes the person through accounts.services.membership_remove
    and revokes the customer's keys they made (the confirmation lists them); the action
    "Remove, keeping their keys" leaves those keys working."""

    list_display = ["user", "customer", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__username", "customer__slug", "customer__name"]
    autocomplete_fields = ["user", "customer"]
    list_select_related = ["user", "customer"]
    actions = ["remove_keeping_keys"]

    def get_deleted_objects(self, objs, request):
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        for membership in objs:
            made = live_api_keys_made_by(membership.customer, [membership.user_id])
            for api_key in made[membership.user_id]:
                deleted.append(f"API key {api_key.prefix} ({api_key.name}): revoked, made by "
                               f"{membership.user}")  # fmt: skip
        return deleted, counts, perms_needed, protected

    def delete_model(self, request, obj):
        membership_remove(membership=obj, revoke_keys=True, actor=actor_of(user=request.user))

    def delete_queryset(self, request, queryset):
        for membership in queryset:
            self.delete_model(request, membership)

    @admin.action(description="Remove the selected people, keeping the keys they made")
    def remove_keeping_keys(self, request, queryset):
        removed = [
            membership_remove(
                membership=membership, revoke_keys=False, actor=actor_of(user=request.user)
            )
            for membership in queryset
        ]
        kept = sum(len(each.kept) for each in removed)
        self.message_user(request, f"Removed {len(removed)} person(s); {kept} key(s) kept.")


@admin.register(ApiKey)
class ApiKeyAdmin(KeysChangedAdminMixin, AuditedAdminMixin, admin.ModelAdmin):
    """Keys are created with `create_api_key` or the API, which show the secret once;
    the admin only reads and revokes them."""

    list_display = [
        "prefix",
        "name",
        "customer",
        "service_name",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_filter = ["service_name", "revoked_at", "expires_at"]
    search_fields = ["prefix", "name", "customer__slug", "service_name"]
    list_select_related = ["customer"]
    # Scopes, expiry and revocation follow the API's rules (a key never gains scopes or life
    # it was not minted with; a revoked key stays revoked), so the admin only renames keys
    # and revokes them with the action.
    readonly_fields = [
        "prefix",
        "secret_sha256",
        "customer",
        "service_name",
        "scopes",
        "created_at",
        "created_by",
        "created_by_key",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    fields = ["name", *readonly_fields]
    actions = ["revoke_selected"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        # Deleting would erase who held the key; revoke it instead.
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke_selected(self, request, queryset):
        for api_key in queryset:
            api_key_revoke(api_key=api_key, actor=actor_of(user=request.user))
        self.message_user(request, f"Revoked {queryset.count()} key(s).")
