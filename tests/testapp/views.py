"""Views guarded by ``@mutex``, for the decorator and middleware tests.

Each guarded view answers with the names of the locks held while it ran, so a
test can see that the right lock (with its name filled from the URL) was held.
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_redis_mutex import (
    LockError,
    LockLost,
    LockNotOwned,
    held_locks,
    mutex,
    skip_if_locked,
)

from .models import Counter


def held_now() -> JsonResponse:
    return JsonResponse({"held": [lock.name for lock in held_locks()]})


@mutex("report")
def report(request: HttpRequest) -> JsonResponse:
    return held_now()


@mutex("report")
async def async_report(request: HttpRequest) -> JsonResponse:
    return await sync_to_async(held_now)()


@mutex("order:{order_id}")
def order(request: HttpRequest, order_id: int) -> JsonResponse:
    return held_now()


@mutex("order:{order_id}")
def missing_placeholder(request: HttpRequest) -> JsonResponse:
    return held_now()


class ItemView(View):
    @mutex("item:{pk}")
    def get(self, request: HttpRequest, pk: int) -> JsonResponse:
        return held_now()


@method_decorator(mutex("item:{pk}"), name="get")
class DecoratedItemView(View):
    def get(self, request: HttpRequest, pk: int) -> JsonResponse:
        return held_now()


class AsyncItemView(View):
    @mutex("item:{pk}")
    async def get(self, request: HttpRequest, pk: int) -> JsonResponse:
        return await sync_to_async(held_now)()


@mutex("counter:{pk}")
def bump(request: HttpRequest, pk: int) -> JsonResponse:
    """Take the same lock Counter.bump takes, then call it: reentrancy, not deadlock."""
    value = Counter.objects.get(pk=pk).bump()
    return JsonResponse({"value": value})


@mutex("busy", blocking=False)
def busy(request: HttpRequest) -> JsonResponse:
    return held_now()


@mutex("busy", shared=True, blocking=False)
def read_busy(request: HttpRequest) -> JsonResponse:
    """Read under "busy" shared: runs beside other readers, 503 while a writer holds it."""
    return held_now()


@mutex("busy", blocking=False)
async def async_busy(request: HttpRequest) -> JsonResponse:
    return await sync_to_async(held_now)()


@mutex("doc:{key}", blocking=False)
def document(request: HttpRequest, key: str) -> JsonResponse:
    """Guarded by a lock named from free text in the URL (any characters, slashes too)."""
    return held_now()


@mutex("flaky", using="down")
def unavailable(request: HttpRequest) -> JsonResponse:
    """Guarded by a lock on the test's "down" alias, whose Redis does not answer."""
    return JsonResponse({"ran": True})


@mutex("flaky", using="down")
async def async_unavailable(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ran": True})


ERRORS: dict[str, Exception] = {
    "value": ValueError("not a lock problem"),
    "lost": LockLost("Lock 'x' was lost while the block ran.", name="x"),
    "not-owned": LockNotOwned("Cannot release lock 'x'.", name="x"),
    "lock-error": LockError("Some other lock problem.", name="x"),
}


def fail(request: HttpRequest, kind: str) -> JsonResponse:
    raise ERRORS[kind]


def _bump_row(alias: str, pk: int, pause: float) -> int:
    """Read-modify-write one Counter row on database ``alias``, pausing in between."""
    value = Counter.objects.using(alias).values_list("value", flat=True).get(pk=pk)
    time.sleep(pause)
    Counter.objects.using(alias).filter(pk=pk).update(value=value + 1)
    return value + 1


def _bump_and_answer(request: HttpRequest, alias: str, pk: int) -> JsonResponse:
    """Bump the row, then do more work (rendering, say) before the view returns."""
    pause = float(request.GET.get("pause", 0))
    value = _bump_row(alias, pk, pause)
    time.sleep(pause)
    return JsonResponse({"value": value})


@mutex("rows:{alias}:{pk}")
def bump_row(request: HttpRequest, alias: str, pk: int) -> JsonResponse:
    """The README's view shape: a read-modify-write under the lock (ATOMIC_REQUESTS on)."""
    return _bump_and_answer(request, alias, pk)


@skip_if_locked("rows:{alias}:{pk}", timeout=30)
def bump_row_unless_busy(request: HttpRequest, alias: str, pk: int) -> JsonResponse:
    """``bump_row`` as work dropped while another request holds the row's lock."""
    return _bump_and_answer(request, alias, pk)


@method_decorator(mutex("rows:{alias}:{pk}"), name="dispatch")
class BumpRowView(View):
    """``bump_row`` as a class-based view, locked on dispatch."""

    def post(self, request: HttpRequest, alias: str, pk: int) -> JsonResponse:
        return _bump_and_answer(request, alias, pk)


@mutex("rows:{alias}:{pk}", release_at_block_end=True)
def _bump_row_releasing_early(alias: str, pk: int, pause: float) -> int:
    return _bump_row(alias, pk, pause)


def bump_row_releasing_early(request: HttpRequest, alias: str, pk: int) -> JsonResponse:
    """What a locked view did under ATOMIC_REQUESTS before: the lock inside, given back first."""
    pause = float(request.GET.get("pause", 0))
    with transaction.atomic(using=alias):
        value = _bump_row_releasing_early(alias, pk, pause)
        time.sleep(pause)  # the rest of the view, inside the request's transaction
    return JsonResponse({"value": value})
