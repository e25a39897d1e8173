"""Declare the unmanaged Lock model so Django creates its permissions (no table is made)."""

from django.db import migrations

from ._unmanaged import unmanaged_model


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        unmanaged_model("Lock", "lock", [("release_lock", "Can force-release locks")], ("view",)),
    ]
