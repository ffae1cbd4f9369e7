from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0023_shard_ran"),
    ]

    operations = [
        migrations.AddField(
            model_name="batch", name="planned_at",
            field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(
            model_name="batch", name="waits_for",
            field=models.CharField(blank=True, default="", db_default="", max_length=16)),
    ]
