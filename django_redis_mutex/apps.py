from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoRedisMutexConfig(AppConfig):
    name = "django_redis_mutex"
    verbose_name = _("Redis locks")

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from . import checks  # noqa: F401  (registers the system checks)
        from .telemetry import update_receivers
        from .transactions import watch_connection, watch_open_connections

        # Lets a lock find the transactions of its thread (and whether they
        # had read before it was taken).
        connection_created.connect(
            watch_connection, dispatch_uid="django_redis_mutex.watch_connection"
        )
        watch_open_connections()

        # Connected only when an alias asks for telemetry: otherwise the lock
        # signals keep no receiver and opentelemetry is never imported.
        update_receivers()
