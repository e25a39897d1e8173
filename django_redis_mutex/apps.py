from django.apps import AppConfig


class DjangoRedisMutexConfig(AppConfig):
    name = "django_redis_mutex"
    verbose_name = "Redis locks"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
