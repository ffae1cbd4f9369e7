from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0003_ops")]

    operations = [
        migrations.AddField(model_name="shard", name="flags_part",
                            field=models.CharField(blank=True, max_length=255)),
        migrations.AddField(model_name="shard", name="flag_counts",
                            field=models.JSONField(blank=True, default=dict)),
        migrations.AddField(model_name="shard", name="json_retries",
                            field=models.PositiveIntegerField(default=0)),
    ]
