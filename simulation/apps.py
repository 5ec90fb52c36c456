from django.apps import AppConfig


class SimulationConfig(AppConfig):
    """Holds `manage.py simulate`; no models."""

    name = "simulation"
    verbose_name = "Simulation"
