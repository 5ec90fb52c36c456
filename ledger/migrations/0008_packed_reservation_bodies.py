"""The reservation's stored answer and queued request are stored packed (``ledger.jsonfields.PackedJSONField``):
bytes, lz4-framed when large, instead of ``jsonb`` parsed and compressed by the server inside the admission's
transaction."""

from django.db import migrations

import ledger.jsonfields


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0007_fast_json_encoder"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="reservation",
                    name="request_body",
                    field=ledger.jsonfields.PackedJSONField(
                        blank=True, help_text="Kept while queued, to admit later.", null=True
                    ),
                ),
                migrations.AlterField(
                    model_name="reservation",
                    name="response_body",
                    field=ledger.jsonfields.PackedJSONField(
                        blank=True, help_text="The first answer, for idempotent replays.", null=True
                    ),
                ),
            ],
            database_operations=[
                ledger.jsonfields.PackColumn("ledger_reservation", "request_body"),
                ledger.jsonfields.PackColumn("ledger_reservation", "response_body"),
            ],
        ),
    ]
