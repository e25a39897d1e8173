from django.contrib import admin
from django.urls import path

from testproject.demo import views

urlpatterns = [
    path("", views.inventory, name="inventory"),
    path("reserve/", views.reserve, name="reserve"),
    path("admin/", admin.site.urls),
]
