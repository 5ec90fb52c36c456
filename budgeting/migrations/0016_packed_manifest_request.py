"""The manifest's request is stored packed (``ledger.jsonfields.PackedJSONField``): bytes, lz4-framed when
large, instead of ``jsonb`` parsed and compressed by the server inside the admission's transaction."""

from django.db import migrations

import ledger.jsonfields


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0015_fast_json_encoder"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="manifest",
                    name="request",
                    field=ledger.jsonfields.PackedJSONField(
                        help_text="The admission request as received (components included) for replay."
                    ),
                ),
            ],
            database_operations=[ledger.jsonfields.PackColumn("budgeting_manifest", "request")],
        ),
    ]
