"""Declare the unmanaged Semaphore model so Django creates its permission (no table is made)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_redis_mutex", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="Semaphore",
            fields=[
                (
                    "name",
                    models.CharField(
                        max_length=1024, primary_key=True, serialize=False, verbose_name="name"
                    ),
                ),
            ],
            options={
                "verbose_name": "semaphore",
                "verbose_name_plural": "semaphores",
                "permissions": [("reset_semaphore", "Can reset semaphores")],
                "managed": False,
                "default_permissions": (),
            },
        ),
    ]
