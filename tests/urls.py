from django.contrib import admin
from django.urls import path, re_path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("report/", views.report),
    path("async-report/", views.async_report),
    path("orders/<int:order_id>/", views.order),
    path("missing-placeholder/", views.missing_placeholder),
    path("items/<int:pk>/", views.ItemView.as_view()),
    path("decorated-items/<int:pk>/", views.DecoratedItemView.as_view()),
    path("async-items/<int:pk>/", views.AsyncItemView.as_view()),
    path("counters/<int:pk>/bump/", views.bump),
    path("rows/<str:alias>/<int:pk>/bump/", views.bump_row),
    path("rows/<str:alias>/<int:pk>/bump-class/", views.BumpRowView.as_view()),
    path("rows/<str:alias>/<int:pk>/bump-unless-busy/", views.bump_row_unless_busy),
    path("rows/<str:alias>/<int:pk>/bump-early/", views.bump_row_releasing_early),
    path("busy/", views.busy),
    path("busy/read/", views.read_busy),
    # Any characters at all, newlines and slashes included (<path:> stops at a newline).
    re_path(r"^documents/(?P<key>(?s:.+))/$", views.document),
    path("async-busy/", views.async_busy),
    path("unavailable/", views.unavailable),
    path("async-unavailable/", views.async_unavailable),
    path("fail/<str:kind>/", views.fail),
]
