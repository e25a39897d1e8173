from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class DjangoRedisMutexConfig(AppConfig):
    name = "django_redis_mutex"
    verbose_name = _("Redis locks")

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .telemetry import update_receivers

        # Connected only when an alias asks for telemetry: otherwise the lock
        # signals keep no receiver and opentelemetry is never imported.
        update_receivers()
