from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "ledger"
    verbose_name = "Capacity ledger"
    default_auto_field = "django.db.models.BigAutoField"
