"""What provisioning last wrote: one row per (object, field) a provisioning file set, with the value it set.

A field whose current value is still this one has not been changed by people since the file's last apply, so
the next apply may change it; any other value was set through another write path and is kept (unless forced).
"""

from __future__ import annotations

from django.db import models


class ProvisionedValue(models.Model):
    target_type = models.CharField(max_length=60, help_text="app_label.model of the provisioned object.")
    target_id = models.CharField(max_length=64)
    field = models.CharField(max_length=60, help_text="Model field name.")
    value = models.JSONField(
        null=True, help_text="As the file states it: relations by natural key, many-to-many as a sorted list."
    )
    source = models.CharField(max_length=150, help_text="The file and its digest, as in the change log.")
    applied_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["target_type", "target_id", "field"], name="provisioned_value_unique_field"
            )
        ]

    def __str__(self) -> str:
        return f"{self.target_type}#{self.target_id}.{self.field}"
