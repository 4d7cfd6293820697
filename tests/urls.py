from django.contrib import admin
from django.urls import include, path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("awa/", include("django_awa.urls")),
    path("async/enqueue/", views.enqueue_view),
    path("async/checkout/", views.checkout_view),
]
