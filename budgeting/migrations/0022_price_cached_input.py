"""A price's cached-input figure; a new price bumps the catalog version, so admission (which prices holds
from the in-process snapshot) sees it on the very next request."""

from django.db import migrations, models

BUMP = (
    "CREATE TRIGGER budgeting_price_bumps_catalog AFTER INSERT OR UPDATE OR DELETE ON budgeting_price "
    "FOR EACH STATEMENT EXECUTE FUNCTION budgeting_bump_catalog_version();"
)
UNBUMP = "DROP TRIGGER IF EXISTS budgeting_price_bumps_catalog ON budgeting_price;"


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0021_mistral_tokenizer_families"),
    ]

    operations = [
        migrations.RunSQL(BUMP, UNBUMP),
        migrations.RemoveConstraint(
            model_name="price",
            name="price_non_negative",
        ),
        migrations.AddField(
            model_name="price",
            name="cached_input_per_million",
            field=models.DecimalField(
                blank=True,
                decimal_places=6,
                help_text="Price of one million cached input tokens; empty means the input price.",
                max_digits=14,
                null=True,
            ),
        ),
        migrations.AddConstraint(
            model_name="price",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("input_per_million__gte", 0),
                    ("output_per_million__gte", 0),
                    models.Q(
                        ("cached_input_per_million__isnull", True),
                        ("cached_input_per_million__gte", 0),
                        _connector="OR",
                    ),
                ),
                name="price_non_negative",
            ),
        ),
    ]
