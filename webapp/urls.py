"""URL routes: pages, the JSON API, the agents' HTTP endpoints, login/logout, Django admin."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import path, re_path
from django.views.generic import RedirectView

from webapp.accounts import api_errors, users
from webapp.accounts import views as accounts
from webapp.agents import views as agents
from webapp.catalog import views as catalog
from webapp.devices import api as devices_api
from webapp.devices import views as devices
from webapp.front import errors
from webapp.front import views as front
from webapp.jobs import api as jobs_api
from webapp.jobs import finding, history
from webapp.jobs import views as jobs

urlpatterns = [
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"))),  # what browsers ask for unprompted
    path("", front.home, name="home"),
    path("devices/", devices.device_list, name="devices"),
    path("devices/add/", devices.device_add, name="device-add"),
    path("devices/<int:device_id>/token/", devices.device_token, name="device-token"),
    path("devices/<int:device_id>/disable/", agents.device_disable, name="device-disable"),
    path("devices/<int:device_id>/enable/", devices.device_enable, name="device-enable"),
    path("devices/<int:device_id>/group/", devices.device_group, name="device-group"),
    path("devices/<int:device_id>/remove/", agents.device_remove, name="device-remove"),
    path("models/", catalog.model_list, name="models"),
    path("models/add/", catalog.model_add, name="model-add"),
    path("models/<int:model_id>/remove/", catalog.model_remove, name="model-remove"),
    path("jobs/", history.job_list, name="jobs"),
    path("jobs/compare/", history.job_compare, name="job-compare"),
    path("jobs/new/", jobs.job_new, name="job-new"),
    path("jobs/<int:job_id>/", jobs.job_detail, name="job"),
    path("jobs/<int:job_id>/replan/", jobs.job_replan, name="job-replan"),
    path("jobs/<int:job_id>/launch/", jobs.job_launch, name="job-launch"),
    path("jobs/<int:job_id>/live/", jobs.job_live, name="job-live"),
    path("jobs/<int:job_id>/planned.json", jobs.job_planned, name="job-planned"),
    path("jobs/<int:job_id>/health.json", jobs.job_health, name="job-health"),
    path("jobs/<int:job_id>/logs/", jobs.job_logs, name="job-logs"),
    path("jobs/<int:job_id>/cancel/", jobs.job_cancel, name="job-cancel"),
    path("jobs/<int:job_id>/again/", history.job_again, name="job-again"),
    path("jobs/<int:job_id>/label/", finding.job_label, name="job-label"),
    path("jobs/<int:job_id>/queue/<str:where>/", jobs.job_queue_move, name="job-queue-move"),
    path("jobs/<int:job_id>/archive/", history.job_archive, name="job-archive"),
    path("jobs/<int:job_id>/delete/", history.job_delete, name="job-delete"),
    path("jobs/<int:job_id>/devices/<str:action>/", jobs.job_device_action, name="job-device-action"),
    path("jobs/<int:job_id>/model.pt", jobs.job_model, name="job-model"),
    path("jobs/<int:job_id>/trace.json", jobs.job_trace, name="job-trace"),
    path("profile/", accounts.profile, name="profile"),
    path("profile/tokens/<int:token_id>/revoke/", accounts.revoke, name="token-revoke"),
    path("users/", users.users, name="users"),
    path("users/invitations/<int:invitation_id>/revoke/", users.revoke_invitation, name="invitation-revoke"),
    path("accounts/join/<str:token>/", users.join, name="join"),
    path("api/devices/", devices_api.devices),
    path("api/devices/<int:device_id>/token/", devices_api.token),
    path("api/jobs/", jobs_api.jobs),
    path("api/jobs/<int:job_id>/", jobs_api.job),
    path("api/jobs/<int:job_id>/launch/", jobs_api.launch),
    path("api/jobs/<int:job_id>/cancel/", jobs_api.cancel),
    path("api/jobs/<int:job_id>/queue/", jobs_api.queue_move),
    re_path(r"^api/jobs/(?P<job_id>[0-9]+)/(?P<action>remove|add|kill)/$", jobs_api.device_action),
    path("api/agent/enroll/", devices_api.enroll),
    path("api/agent/ca/", devices_api.ca),
    path("api/agent/link/", devices_api.link_probe),
    path("api/agent/link/slot/", devices_api.link_slot),
    path("api/agent/jobs/<int:job_id>/part/", jobs_api.upload_part),
    re_path(r"^api/", api_errors.not_found),  # after every API route: the rest of /api/ is a JSON 404
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    re_path(r"", errors.not_found),  # last: a path no page has is the site's 404, DEBUG or not
]
