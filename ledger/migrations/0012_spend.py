"""Money beside tokens: spend limits and balances on accounts, spend columns on entries, the prices frozen on a
reservation and its money conservation; and the price history made unrewritable in the database.

A price version a reservation froze cannot be updated or deleted, and once a model revision's prices were used
no new price of it may start in the past (``now()`` is the transaction's start, so a price "from now" written
in the same transaction passes): a correction is a new version from now on.
"""

import django.db.models.deletion
import django.db.models.expressions
from django.db import migrations, models

PRICE_HISTORY = """
CREATE OR REPLACE FUNCTION ledger_price_history_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE')
       AND EXISTS (SELECT 1 FROM ledger_reservation WHERE price_id = OLD.id) THEN
        RAISE EXCEPTION 'price % was used by an admission: it cannot be changed; add a new price from now', OLD.id
            USING ERRCODE = 'TB409';
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.effective_from < now()
       AND EXISTS (SELECT 1 FROM ledger_reservation WHERE price_id IN (
               SELECT id FROM budgeting_price WHERE model_revision_id = NEW.model_revision_id)) THEN
        RAISE EXCEPTION 'a price of % cannot start in the past (%): admissions used its prices',
            NEW.model_revision_id, NEW.effective_from
            USING ERRCODE = 'TB409';
    END IF;
    RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
END $$;
CREATE TRIGGER budgeting_price_history_kept BEFORE INSERT OR UPDATE OR DELETE ON budgeting_price
    FOR EACH ROW EXECUTE FUNCTION ledger_price_history_kept();
"""
DROP_PRICE_HISTORY = """
DROP TRIGGER IF EXISTS budgeting_price_history_kept ON budgeting_price;
DROP FUNCTION IF EXISTS ledger_price_history_kept();
"""

# An account's spend balances are in its currency: it changes only while they are zero (no mixed sums). The
# trigger fires only on an UPDATE naming the column, never on the hot path's balance updates.
CURRENCY_KEPT = """
CREATE OR REPLACE FUNCTION ledger_account_currency_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.currency IS DISTINCT FROM OLD.currency AND (OLD.spend_reserved <> 0 OR OLD.spend_consumed <> 0) THEN
        RAISE EXCEPTION 'account % holds or posted spend in %: its currency cannot change now', OLD.id, OLD.currency
            USING ERRCODE = 'TB409';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER ledger_capacityaccount_currency_kept BEFORE UPDATE OF currency ON ledger_capacityaccount
    FOR EACH ROW EXECUTE FUNCTION ledger_account_currency_kept();
"""
DROP_CURRENCY_KEPT = """
DROP TRIGGER IF EXISTS ledger_capacityaccount_currency_kept ON ledger_capacityaccount;
DROP FUNCTION IF EXISTS ledger_account_currency_kept();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("budgeting", "0022_price_cached_input"),
        ("ledger", "0011_slot_free_entries"),
    ]

    operations = [
        migrations.RunSQL(PRICE_HISTORY, DROP_PRICE_HISTORY),
        migrations.AddField(
            model_name="capacityaccount",
            name="currency",
            field=models.CharField(
                default="USD", help_text="ISO 4217 code of the spend limit and spend balances.", max_length=3
            ),
        ),
        migrations.AddField(
            model_name="capacityaccount",
            name="spend_consumed",
            field=models.BigIntegerField(default=0, help_text="Micro-units posted this period."),
        ),
        migrations.AddField(
            model_name="capacityaccount",
            name="spend_limit",
            field=models.BigIntegerField(
                blank=True,
                help_text="Micro-units of the currency per period; empty means unlimited.",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="capacityaccount",
            name="spend_reserved",
            field=models.BigIntegerField(default=0, help_text="Micro-units held."),
        ),
        migrations.AddField(
            model_name="ledgerentry",
            name="spend_consumed",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="ledgerentry",
            name="spend_reserved",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="reservation",
            name="cached_input_price",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="reservation",
            name="currency",
            field=models.CharField(blank=True, max_length=3),
        ),
        migrations.AddField(
            model_name="reservation",
            name="input_cached",
            field=models.BigIntegerField(
                default=0, help_text="Input tokens the provider reported as cached."
            ),
        ),
        migrations.AddField(
            model_name="reservation",
            name="input_price",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="reservation",
            name="output_price",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="reservation",
            name="price",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="budgeting.price",
            ),
        ),
        migrations.AddField(
            model_name="reservation",
            name="spend_captured",
            field=models.BigIntegerField(default=0, help_text="Posted out of the hold."),
        ),
        migrations.AddField(
            model_name="reservation",
            name="spend_overrun",
            field=models.BigIntegerField(default=0, help_text="Posted beyond the hold."),
        ),
        migrations.AddField(
            model_name="reservation",
            name="spend_released",
            field=models.BigIntegerField(default=0, help_text="Given back (released or refunded)."),
        ),
        migrations.AddField(
            model_name="reservation",
            name="spend_remaining",
            field=models.BigIntegerField(default=0, help_text="Still held."),
        ),
        migrations.AddField(
            model_name="reservation",
            name="spend_reserved",
            field=models.BigIntegerField(default=0, help_text="Held at admission and by top-ups."),
        ),
        migrations.AddConstraint(
            model_name="capacityaccount",
            constraint=models.CheckConstraint(
                condition=models.Q(("spend_reserved__gte", 0), ("spend_consumed__gte", 0)),
                name="account_spend_non_negative",
            ),
        ),
        migrations.AddConstraint(
            model_name="capacityaccount",
            constraint=models.CheckConstraint(
                condition=models.Q(("spend_limit__isnull", True), ("spend_limit__gte", 0), _connector="OR"),
                name="account_spend_limit_non_negative",
            ),
        ),
        migrations.AddConstraint(
            model_name="capacityaccount",
            constraint=models.CheckConstraint(
                condition=models.Q(("currency__regex", "^[A-Z]{3}$")), name="account_currency_iso"
            ),
        ),
        migrations.AddConstraint(
            model_name="reservation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("spend_reserved__gte", 0),
                    ("spend_captured__gte", 0),
                    ("spend_remaining__gte", 0),
                    ("spend_released__gte", 0),
                    ("spend_overrun__gte", 0),
                    ("input_cached__gte", 0),
                ),
                name="reservation_spend_non_negative",
            ),
        ),
        migrations.AddConstraint(
            model_name="reservation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "spend_reserved",
                        django.db.models.expressions.CombinedExpression(
                            django.db.models.expressions.CombinedExpression(
                                models.F("spend_captured"), "+", models.F("spend_remaining")
                            ),
                            "+",
                            models.F("spend_released"),
                        ),
                    )
                ),
                name="reservation_spend_conservation",
            ),
        ),
        migrations.RunSQL(CURRENCY_KEPT, DROP_CURRENCY_KEPT),
    ]
