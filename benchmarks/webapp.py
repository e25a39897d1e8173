"""The Django app of the request scenario: the same tiny view with and without a lock.

Each view answers ``ok``; they differ only in what runs around it:

* ``plain/<pk>``: nothing;
* ``locked/<pk>``: this app's ``@mutex("web:{pk}")`` (the lock of that pk,
  taken and released around the view), behind ``MutexMiddleware``;
* ``raw/<pk>``: one raw lock cycle, ``SET NX PX`` then a compare-and-delete
  script on a plain redis-py client: the floor of any Redis lock.

``a``-prefixed twins (``aplain``, ``alocked``, ``araw``) are async views for
an ASGI server. Every load-generating client uses its own pk, so no request
waits for another: the difference between the views is the lock's own cost.

Servers import this module with ``BENCH_REDIS_URL`` and ``BENCH_KEY_PREFIX``
set; the benchmark process imports it with Django already configured.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from django.conf import settings

if not settings.configured:
    from django_config import configure_django

    configure_django(os.environ["BENCH_REDIS_URL"], os.environ["BENCH_KEY_PREFIX"])

import redis
import redis.asyncio as aioredis
from django.http import HttpRequest, HttpResponse
from django.urls import path

from django_redis_mutex import mutex

LEASE_MS = 30_000
COMPARE_AND_DELETE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
_URL = settings.CACHES["default"]["LOCATION"]
_PREFIX = settings.CACHES["default"]["KEY_PREFIX"]
_sync_script: Any = None
_async_scripts: dict[Any, Any] = {}


def _raw_name(pk: int) -> str:
    return f"{_PREFIX}:raw:{pk}"


def plain(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse(b"ok")


@mutex("web:{pk}")
def locked(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse(b"ok")


def raw(request: HttpRequest, pk: int) -> HttpResponse:
    global _sync_script
    if _sync_script is None:
        _sync_script = redis.Redis.from_url(_URL).register_script(COMPARE_AND_DELETE)
    client, token = _sync_script.registered_client, secrets.token_hex(16)
    if not client.set(_raw_name(pk), token, nx=True, px=LEASE_MS):
        return HttpResponse(b"busy", status=503)
    _sync_script(keys=[_raw_name(pk)], args=[token])  # EVALSHA
    return HttpResponse(b"ok")


async def aplain(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse(b"ok")


@mutex("web:{pk}")
async def alocked(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse(b"ok")


async def araw(request: HttpRequest, pk: int) -> HttpResponse:
    import asyncio

    loop = asyncio.get_running_loop()
    script = _async_scripts.get(loop)
    if script is None:
        script = aioredis.Redis.from_url(_URL).register_script(COMPARE_AND_DELETE)
        _async_scripts[loop] = script
    client, token = script.registered_client, secrets.token_hex(16)
    if not await client.set(_raw_name(pk), token, nx=True, px=LEASE_MS):
        return HttpResponse(b"busy", status=503)
    await script(keys=[_raw_name(pk)], args=[token])  # EVALSHA
    return HttpResponse(b"ok")


urlpatterns = [
    path(f"{view.__name__}/<int:pk>", view) for view in (plain, locked, raw, aplain, alocked, araw)
]


_handlers: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    # The WSGI and ASGI handlers are built only by the server that asks for one.
    if name not in ("wsgi_app", "asgi_app"):
        raise AttributeError(name)
    if name not in _handlers:
        if name == "wsgi_app":
            from django.core.wsgi import get_wsgi_application

            _handlers[name] = get_wsgi_application()
        else:
            from django.core.asgi import get_asgi_application

            _handlers[name] = get_asgi_application()
    return _handlers[name]
