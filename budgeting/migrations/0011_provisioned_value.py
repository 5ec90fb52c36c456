# What provisioning files last wrote, per object and field (budgeting.provisioning.models).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0010_catalog_version"),
    ]

    operations = [
        migrations.CreateModel(
            name="ProvisionedValue",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "target_type",
                    models.CharField(help_text="app_label.model of the provisioned object.", max_length=60),
                ),
                ("target_id", models.CharField(max_length=64)),
                ("field", models.CharField(help_text="Model field name.", max_length=60)),
                (
                    "value",
                    models.JSONField(
                        help_text="As the file states it: relations by natural key, many-to-many as a sorted list.",
                        null=True,
                    ),
                ),
                (
                    "source",
                    models.CharField(
                        help_text="The file and its digest, as in the change log.", max_length=150
                    ),
                ),
                ("applied_at", models.DateTimeField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("target_type", "target_id", "field"), name="provisioned_value_unique_field"
                    )
                ],
            },
        ),
    ]
