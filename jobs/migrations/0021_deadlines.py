from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0020_storage_grants"),
    ]

    operations = [
        migrations.AddField(
            model_name="batch", name="work_input_tokens",
            field=models.BigIntegerField(default=0)),
        migrations.AddField(
            model_name="batch", name="work_output_tokens",
            field=models.BigIntegerField(default=0)),
        migrations.AddField(
            model_name="batch", name="expected_completion_at",
            field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(
            model_name="batch", name="at_risk", field=models.BooleanField(default=False)),
        migrations.AddField(
            model_name="batch", name="urgent", field=models.BooleanField(default=False)),
        migrations.AddField(
            model_name="batch", name="pace_at",
            field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(
            model_name="batch", name="pace_answered",
            field=models.PositiveIntegerField(default=0)),
    ]
