"""New reservations' ids grow with time (``ledger.models.new_reservation_id``): the ids of rows written
before stay as they are, and no statement runs (Django alone fills the default)."""

from django.db import migrations, models

import ledger.models


class Migration(migrations.Migration):
    dependencies = [("ledger", "0013_require_unchanged")]

    operations = [
        migrations.AlterField(
            model_name="reservation",
            name="id",
            field=models.UUIDField(
                default=ledger.models.new_reservation_id, editable=False, primary_key=True, serialize=False
            ),
        ),
    ]
