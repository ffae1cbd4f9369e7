from django.db import migrations, models


class Migration(migrations.Migration):
    """Uploads keep the expiry their file gets (expires_after); Message Batches record when
    their results were archived, and the counts they had then; reasoning tokens are counted
    on shards and batches and in the usage ledger. Error files keep their stored purpose
    (`batch_error`): the Files API shows it as `batch_output` (File.SHOWN_PURPOSES), so no
    row changes."""

    dependencies = [
        ("jobs", "0018_usage_eval_runs"),
    ]

    operations = [
        migrations.AddField(
            model_name="upload",
            name="file_expires_after",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="batch",
            name="archived_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="batch",
            name="archived_counts",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="batch",
            name="reasoning_tokens",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="shard",
            name="reasoning_tokens",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="reasoning_tokens",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="usageday",
            name="reasoning_tokens",
            field=models.BigIntegerField(default=0),
        ),
    ]
