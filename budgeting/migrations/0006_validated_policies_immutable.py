"""A validated policy version is immutable: a trigger refuses changing its document, revision or state, and
deleting it (its note may still be edited). Written to be safe on a database where an earlier draft of
migration 0003 already created it."""

from django.db import migrations

VALIDATED_IMMUTABLE = """
CREATE OR REPLACE FUNCTION budgeting_policyversion_immutable() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'policy r% is validated and cannot be deleted', OLD.revision
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.document IS DISTINCT FROM OLD.document OR NEW.revision <> OLD.revision OR NEW.state <> OLD.state THEN
        RAISE EXCEPTION 'policy r% is validated and immutable', OLD.revision USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS budgeting_policyversion_immutable ON budgeting_policyversion;
CREATE TRIGGER budgeting_policyversion_immutable
    BEFORE UPDATE OR DELETE ON budgeting_policyversion
    FOR EACH ROW WHEN (OLD.state = 'VALIDATED') EXECUTE FUNCTION budgeting_policyversion_immutable();
"""

DROP_VALIDATED_IMMUTABLE = """
DROP TRIGGER IF EXISTS budgeting_policyversion_immutable ON budgeting_policyversion;
DROP FUNCTION IF EXISTS budgeting_policyversion_immutable();
"""


class Migration(migrations.Migration):
    dependencies = [("budgeting", "0005_change_log_names")]

    operations = [migrations.RunSQL(VALIDATED_IMMUTABLE, DROP_VALIDATED_IMMUTABLE)]
