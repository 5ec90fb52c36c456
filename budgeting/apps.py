from django.apps import AppConfig


class BudgetingConfig(AppConfig):
    name = "budgeting"
    verbose_name = "Catalog and admission"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished

        from budgeting.admission.count_cache import flush_held_counts
        from budgeting.api import openapi  # noqa: F401  (registers the OpenAPI auth extension)

        # The counts learned while answering go to Redis once the answer is sent.
        request_finished.connect(flush_held_counts, dispatch_uid="flush_held_counts")
