"""Declare the unmanaged Semaphore model so Django creates its permission (no table is made)."""

from django.db import migrations

from ._unmanaged import unmanaged_model


class Migration(migrations.Migration):
    dependencies = [
        ("django_redis_mutex", "0001_initial"),
    ]

    operations = [
        unmanaged_model(
            "Semaphore", "semaphore", [("reset_semaphore", "Can reset semaphores")], ()
        ),
    ]
