"""Demo views: an inventory whose reserve action runs under ``@mutex("inventory")``."""

import time

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from django_redis_mutex import LockContended, held_locks, mutex

STOCK_KEY = "demo:stock"


def _stock() -> int:
    from django.core.cache import cache

    return int(cache.get_or_set(STOCK_KEY, 100))


def inventory(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "demo/inventory.html",
        {"stock": _stock(), "locks": held_locks(), "message": request.GET.get("message", "")},
    )


@mutex("inventory", label="reserve view")
def _reserve_one() -> int:
    from django.core.cache import cache

    stock = _stock()
    time.sleep(0.5)  # a slow read-modify-write: only safe under the lock
    cache.set(STOCK_KEY, stock - 1)
    return stock - 1


@require_POST
def reserve(request: HttpRequest) -> HttpResponse:
    try:
        left = _reserve_one()
    except LockContended as exc:
        return HttpResponse(
            f"Inventory is locked; retry in {exc.retry_after}s.", status=503,
            headers={"Retry-After": str(exc.retry_after)},
        )
    return redirect(f"/?message=Reserved+one;+{left}+left")
