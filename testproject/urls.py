from django.contrib import admin
from django.urls import path

from testproject.demo import views

urlpatterns = [
    path("", views.inventory, name="inventory"),
    path("reserve/<int:pk>/", views.reserve, name="reserve"),
    path("hold/", views.hold, name="hold"),
    path("admin/", admin.site.urls),
]
