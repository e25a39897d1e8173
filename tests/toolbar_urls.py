"""URLconf of tests/test_debug_toolbar.py.

A module of its own because ``debug_toolbar.urls`` can only be imported while
the toolbar app is installed, which those tests arrange with ``override_settings``.
"""

from django.urls import include, path

from . import test_debug_toolbar as views

urlpatterns = [
    path("reserve/", views.reserve),
    path("in-transaction/", views.in_transaction),
    path("plain/", views.plain),
    path("read/", views.read),
    path("lose/", views.lose),
    path("unreachable/", views.unreachable),
    path("locked/<str:name>/", views.locked),
    path("async-locked/<str:name>/", views.alocked),
    path("__debug__/", include("debug_toolbar.urls")),
]
