"""URL routes: home page, login/logout, Django admin."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from webapp.front import views as front

urlpatterns = [
    path("", front.home, name="home"),
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
]
