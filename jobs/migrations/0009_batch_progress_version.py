from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0008_shard_checkpoint'),
    ]

    operations = [
        migrations.AddField(
            model_name='batch',
            name='progress_version',
            field=models.PositiveBigIntegerField(default=0),
        ),
    ]
