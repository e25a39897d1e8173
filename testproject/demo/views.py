"""Demo views: the inventory page, its locked actions, and a lock you can hold on purpose."""

import threading

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from django_redis_mutex import LockBackendUnavailable, Mutex, held_locks, mutex

from .models import Product

HOLD_SECONDS = 20


def inventory(request: HttpRequest) -> HttpResponse:
    try:
        locks = held_locks()
        redis_error = ""
    except LockBackendUnavailable as exc:
        locks, redis_error = [], str(exc)
    return render(
        request,
        "demo/inventory.html",
        {
            "products": Product.objects.all(),
            "locks": locks,
            "redis_error": redis_error,
            "hold_seconds": HOLD_SECONDS,
        },
    )


@require_POST
@mutex("inventory", timeout=2, label="reserve view")
def reserve(request: HttpRequest, pk: int) -> HttpResponse:
    """Reserve one unit. Runs under "inventory", then the product's own lock.

    When someone holds "inventory" for longer than the 2 s timeout, the view
    raises LockContended and MutexMiddleware answers 503 with Retry-After.
    """
    product = get_object_or_404(Product, pk=pk)
    try:
        left = product.reserve()
    except ValueError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Reserved one {product.name}; {left} left.")
    return redirect("inventory")


def _hold(lock: Mutex) -> None:
    try:
        threading.Event().wait(HOLD_SECONDS)
    finally:
        lock.release()


@require_POST
def hold(request: HttpRequest) -> HttpResponse:
    """Take the "inventory" lock for 20 s in a background thread.

    Reserve from another tab meanwhile: it waits 2 s, then gets the 503 page.
    """
    lock = Mutex("inventory", label=f"held on purpose for {HOLD_SECONDS}s", timeout=0)
    if lock.acquire(blocking=False):
        threading.Thread(target=_hold, args=(lock,), daemon=True).start()
        messages.info(
            request, f"Holding the inventory lock for {HOLD_SECONDS}s (fence {lock.fence})."
        )
    else:
        messages.warning(request, "The inventory lock is already held.")
    return redirect("inventory")
