"""The one shape of this app's migrations: declaring an unmanaged model.

Neither model of the app has a table. A migration only tells Django that the
model exists, so that its content type and permissions are created. Frozen:
the migrations that call this must build what they built when they were
applied, so nothing here may change; a new shape gets a new function.
"""

from __future__ import annotations

from django.db import migrations, models


def unmanaged_model(
    name: str,
    verbose_name: str,
    permissions: list[tuple[str, str]],
    default_permissions: tuple[str, ...],
) -> migrations.CreateModel:
    """Return the CreateModel of a table-less model keyed by a lock or semaphore name."""
    key = models.CharField(max_length=1024, primary_key=True, serialize=False, verbose_name="name")
    return migrations.CreateModel(
        name=name,
        fields=[("name", key)],
        options={
            "verbose_name": verbose_name,
            "verbose_name_plural": f"{verbose_name}s",
            "permissions": permissions,
            "managed": False,
            "default_permissions": default_permissions,
        },
    )
