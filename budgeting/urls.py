from django.contrib import admin
from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from budgeting.api import openapi, problem_pages, views
from budgeting.backoffice.reports import views as report_views
from budgeting.observability import scrape

R = "api/v1/reservations/<str:reservation_id>"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", views.IndexView.as_view(), name="api-index"),
    path("problems/<str:slug>", problem_pages.problem_page, name="problem"),
    path("api/v1/admissions", views.AdmissionView.as_view(), name="admissions"),
    path("api/v1/admissions:count", views.CountView.as_view(), name="admissions-count"),
    path("api/v1/reservations:usage", views.UsageReportsView.as_view(), name="usage-reports"),
    path(R, views.ReservationView.as_view(), name="reservation"),
    path(f"{R}/dispatch", views.DispatchView.as_view(), name="reservation-dispatch"),
    path(f"{R}/usage", views.UsageView.as_view(), name="reservation-usage"),
    path(f"{R}/top-up", views.TopUpView.as_view(), name="reservation-top-up"),
    path(f"{R}/cancel", views.CancelView.as_view(), name="reservation-cancel"),
    path(f"{R}/fail", views.FailView.as_view(), name="reservation-fail"),
    path(f"{R}/lease", views.LeaseView.as_view(), name="reservation-lease"),
    path(f"{R}/outcome", views.OutcomeView.as_view(), name="reservation-outcome"),
    path(
        "api/v1/schema",
        SpectacularAPIView.as_view(
            authentication_classes=[],
            permission_classes=[],
            custom_settings={"POSTPROCESSING_HOOKS": openapi.POSTPROCESSING_HOOKS},
        ),
        name="schema",
    ),
]

# The people's side: Prometheus scrape and the analysts' reports (staff session users, not gateway tokens).
urlpatterns += [
    path("metrics", scrape.metrics_view, name="metrics"),
    path("api/v1/reports", report_views.reports_api, name="reports"),
]
