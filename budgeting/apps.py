from django.apps import AppConfig


class BudgetingConfig(AppConfig):
    name = "budgeting"
    verbose_name = "Catalog and admission"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from budgeting.api import openapi  # noqa: F401  (registers the OpenAPI auth extension)
