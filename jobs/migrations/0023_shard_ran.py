from django.db import migrations, models
from django.db.models import F


def from_counts(apps, schema_editor):
    # Shards run before these were counted: their finished requests, the best figure known
    # (what the pages showed for them until now).
    Shard = apps.get_model("jobs", "Shard")
    Shard.objects.update(ran_ok=F("completed"), ran_failed=F("failed"))


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0022_grant_read_not_implied"),
    ]

    operations = [
        migrations.AddField(model_name="shard", name="ran_ok",
                            field=models.PositiveIntegerField(default=0, db_default=0)),
        migrations.AddField(model_name="shard", name="ran_failed",
                            field=models.PositiveIntegerField(default=0, db_default=0)),
        migrations.RunPython(from_counts, migrations.RunPython.noop),
    ]
