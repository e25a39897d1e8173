"""Turn a lock a view could not get into an HTTP 503 the client can act on.

A view guarded by ``@mutex(...)`` raises LockContended when another owner
holds its lock, and LockBackendUnavailable when Redis cannot be reached. Left
alone, both become a 500 and an error report; they are really "busy, come back
later", so :class:`MutexMiddleware` answers ``503 Service Unavailable`` with a
``Retry-After`` header instead. Browsers (an ``Accept`` header naming
``text/html``) get the page ``django_redis_mutex/503.html``; everything else
gets JSON. Every other exception passes through untouched.

Django logs every 5xx on ``django.request`` at ERROR, which mails the admins.
Contention is the lock doing its job, so its 503 is logged at WARNING (like a
4xx); an unreachable Redis stays an ERROR, with the cause in the message.
"""

from __future__ import annotations

import math
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.utils.cache import add_never_cache_headers, patch_vary_headers
from django.utils.deprecation import MiddlewareMixin
from django.utils.http import parse_header_parameters
from django.utils.log import log_response

from .display import terminal_safe
from .exceptions import LockBackendUnavailable, LockContended

__all__ = ["MutexMiddleware", "wants_html"]


def _quality(params: dict[str, str]) -> float:
    try:
        return float(params.get("q", "1"))
    except ValueError:
        return 0.0


def wants_html(request: HttpRequest) -> bool:
    """Return True if the request's Accept header names ``text/html``.

    A wildcard (``*/*``, ``text/*``) or a missing header means an API client
    or a tool, which is better served by JSON. ``text/html;q=0`` refuses HTML,
    and a client ranking ``application/json`` above ``text/html`` gets JSON.
    """
    html = json = 0.0
    for media_range in request.headers.get("Accept", "").split(","):
        media_type, params = parse_header_parameters(media_range)
        media_type = media_type.strip().lower()
        if media_type == "text/html":
            html = max(html, _quality(params))
        elif media_type == "application/json":
            json = max(json, _quality(params))
    return html > 0 and html >= json


class MutexMiddleware(MiddlewareMixin):
    """Answer LockContended and LockBackendUnavailable from a view with a 503.

    Works under WSGI and ASGI, with sync and async views. Subclass to change
    ``template_name``, or ``unavailable_retry_after`` (seconds a client is told
    to wait when Redis is unreachable; the exception carries no better value).
    """

    template_name = "django_redis_mutex/503.html"
    unavailable_retry_after = 5

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """Return a 503 for a lock that could not be had; None lets anything else propagate.

        Django's handler runs exception middleware synchronously (in a thread
        under ASGI), so this one method serves sync and async views alike.
        """
        if isinstance(exception, LockContended):
            retry_after = max(1, math.ceil(exception.retry_after))
            response = self.unavailable(request, lock=exception.name, retry_after=retry_after)
            # Contention is the lock doing its job, not a server error: log it
            # like a 4xx, so error mail (AdminEmailHandler) is not sent for it.
            message = "Service Unavailable (lock %r is held, retry after %ss): %s"
            args: tuple[Any, ...] = (exception.name, retry_after, request.path)
            level = "warning"
        elif isinstance(exception, LockBackendUnavailable):
            # Redis itself is the problem, not one lock: the body names none,
            # and the error log keeps the cause.
            response = self.unavailable(
                request, lock=None, retry_after=self.unavailable_retry_after
            )
            message = "Service Unavailable: %s: %s"
            args = (request.path, exception)
            level = "error"
        else:
            return None
        log_response(message, *args, response=response, request=request, level=level)
        return response

    def unavailable(
        self, request: HttpRequest, *, lock: str | None, retry_after: int
    ) -> HttpResponse:
        """Build the 503 response: HTML for browsers, JSON for everyone else.

        ``lock`` is the name of the contended lock, or None when Redis itself
        was unavailable.
        """
        response: HttpResponse
        if wants_html(request):
            # A person reads the page: control and bidi characters of a name
            # built from request data are shown escaped (JSON keeps them exact).
            shown = None if lock is None else terminal_safe(lock)
            context = {"lock": shown, "retry_after": retry_after}
            response = HttpResponse(
                render_to_string(self.template_name, context, request=request), status=503
            )
        elif lock is None:
            response = JsonResponse({"error": "lock backend unavailable"}, status=503)
        else:
            response = JsonResponse(
                {"error": "locked", "lock": lock, "retry_after": retry_after}, status=503
            )
        response["Retry-After"] = str(retry_after)
        # The body depends on Accept, and a "busy" answer must not be cached.
        patch_vary_headers(response, ["Accept"])
        add_never_cache_headers(response)
        return response
