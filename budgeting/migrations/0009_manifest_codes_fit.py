# Column widths derived from the codes each column stores (budgeting.admission.models.Decision, Answer, RUNGS).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0008_manifest_answer"),
    ]

    operations = [
        migrations.AlterField(
            model_name="manifest",
            name="answer",
            field=models.CharField(
                blank=True, help_text="What the caller was finally answered.", max_length=28
            ),
        ),
        migrations.AlterField(
            model_name="manifest",
            name="decision",
            field=models.CharField(help_text="What the ladder decided.", max_length=28),
        ),
        migrations.AlterField(
            model_name="manifest",
            name="rung",
            field=models.CharField(max_length=15),
        ),
    ]
