from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0013_usage_ledger"),
    ]

    operations = [
        migrations.AddField(
            model_name="batch",
            name="strict",
            field=models.BooleanField(default=False),
        ),
        migrations.AlterField(
            model_name="contentrule",
            name="action",
            field=models.CharField(
                choices=[
                    ("reject", "Fail the request (error file; the whole batch if strict)"),
                    ("reject_batch", "Fail the whole batch"),
                    ("skip", "Skip the line (error file, even if strict)"),
                ],
                default="reject",
                max_length=20,
            ),
        ),
        migrations.AlterField(
            model_name="screenedline",
            name="rule",
            field=models.CharField(blank=True, max_length=100),
        ),
        migrations.AddField(
            model_name="screenedline",
            name="code",
            field=models.CharField(blank=True, max_length=50),
        ),
        migrations.AddField(
            model_name="screenedline",
            name="param",
            field=models.CharField(blank=True, max_length=200),
        ),
        migrations.AddField(
            model_name="screenedline",
            name="message",
            field=models.TextField(blank=True),
        ),
    ]
