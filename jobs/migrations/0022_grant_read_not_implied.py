from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0021_deadlines"),
    ]

    operations = [
        migrations.AlterField(
            model_name="storagegrant", name="read",
            field=models.BooleanField(default=False, help_text=(
                "May register objects under the prefix as batch input files (read in "
                "place).")),
        ),
    ]
