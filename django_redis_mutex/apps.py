from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoRedisMutexConfig(AppConfig):
    name = "django_redis_mutex"
    verbose_name = _("Redis locks")

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from . import checks  # noqa: F401  (registers the system checks)
        from .telemetry import update_receivers
        from .transactions import note_queries

        # Tells a lock taken inside a transaction that had already read.
        connection_created.connect(note_queries, dispatch_uid="django_redis_mutex.note_queries")

        # Connected only when an alias asks for telemetry: otherwise the lock
        # signals keep no receiver and opentelemetry is never imported.
        update_receivers()
