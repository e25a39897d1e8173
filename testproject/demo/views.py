"""Demo views: the inventory page, its locked actions, and a lock you can hold on purpose."""

import logging
import threading
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from django_redis_mutex import (
    LockBackendUnavailable,
    LockLost,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
)
from django_redis_mutex.chart import contention_chart
from django_redis_mutex.stats import read_stats

from .models import Product

log = logging.getLogger(__name__)


def _redis_address() -> str:
    """Return host:port of the default cache's Redis, for messages people read."""
    location = settings.CACHES["default"]["LOCATION"]
    first = location if isinstance(location, str) else next(iter(location), "")
    parts = urlsplit(first)
    return f"{parts.hostname}:{parts.port}" if parts.hostname else str(location)


def redis_down_message(exc: LockBackendUnavailable) -> str:
    """Say that Redis is down in words for the page, from the error's cause.

    The exception's own text names the lock being handled, which for a listing
    is the internal wildcard; the page names the server and the reason instead.
    """
    cause = exc.__cause__ or exc.__context__
    reason = f" ({cause})" if cause else ""
    return (
        f"Redis at {_redis_address()} cannot be reached right now{reason}, so the "
        "locks cannot be listed and reservations answer 503 until it is back."
    )


# How often the inventory page reads its figures again.
REFRESH_SECONDS = 5


def inventory(request: HttpRequest) -> HttpResponse:
    """The inventory page; with ``?figures=1``, only fresh figures for the page's script.

    A figures-only read leaves the visitor's messages unread: they belong to
    the page a click is about to show, perhaps in another tab.
    """
    try:
        locks = held_locks()
        # The last quarter of an hour of contention, as the processes flushed it.
        chart = contention_chart(read_stats(minutes=15))
        redis_error = ""
    except LockBackendUnavailable as exc:
        locks, chart, redis_error = [], None, redis_down_message(exc)
    return render(
        request,
        "demo/inventory.html",
        {
            "products": Product.objects.all(),
            "locks": locks,
            "chart": chart,
            "redis_error": redis_error,
            "hold_seconds": settings.DEMO_HOLD_SECONDS,
            "refresh_seconds": REFRESH_SECONDS,
            "figures_only": request.GET.get("figures") == "1",
        },
    )


@require_POST
@mutex("inventory", timeout=2, label="reserve view")
def reserve(request: HttpRequest, pk: int) -> HttpResponse:
    """Reserve one unit. Runs under "inventory", then the product's own lock.

    When someone holds "inventory" for longer than the 2 s timeout, the view
    raises LockContended and MutexMiddleware answers 503 with Retry-After.
    """
    # The request's transaction (ATOMIC_REQUESTS) began after "inventory" was
    # taken. Nothing is read before the product's own lock either: reserve()
    # reads the row under it, and the lock is kept until the transaction
    # commits, so the next reservation reads the stock this one wrote.
    product = Product(pk=pk)
    try:
        left = product.reserve()
    except Product.DoesNotExist:
        raise Http404(f"No product {pk}.") from None
    except ValueError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Reserved one {product.name}; {left} left.")
    return redirect("inventory")


def _hold(lock: Mutex, seconds: float) -> None:
    """Hold ``lock`` for ``seconds``, then release it.

    Someone may force-release the lock meanwhile (admin, ``locks --reset``) or
    Redis may go away: that is what the demo is for, so it is one log line,
    not a thread dying with a traceback.
    """
    threading.Event().wait(seconds)
    try:
        lock.release()
    except (LockNotOwned, LockLost, LockBackendUnavailable) as exc:
        log.warning("The held inventory lock was already gone at release: %s", exc)


@require_POST
def hold(request: HttpRequest) -> HttpResponse:
    """Take the "inventory" lock for DEMO_HOLD_SECONDS (20 s) in a background thread.

    Reserve from another tab meanwhile: it waits 2 s, then gets the 503 page.
    """
    seconds = settings.DEMO_HOLD_SECONDS
    lock = Mutex("inventory", label=f"held on purpose for {seconds}s", timeout=0)
    try:
        acquired = lock.acquire(blocking=False)
    except LockBackendUnavailable as exc:
        messages.error(request, redis_down_message(exc))
        return redirect("inventory")
    if acquired:
        threading.Thread(target=_hold, args=(lock, seconds), daemon=True).start()
        messages.info(request, f"Holding the inventory lock for {seconds}s (fence {lock.fence}).")
    else:
        messages.warning(request, "The inventory lock is already held.")
    return redirect("inventory")
