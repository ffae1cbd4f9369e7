# Data by reference: storage grants (bucket prefixes opened to users or groups), files
# registered from an object in place, and results delivered to a prefix.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("jobs", "0019_contract_gaps"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='batch',
            name='delivered_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='batch',
            name='delivery_attempts',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='batch',
            name='delivery_error',
            field=models.TextField(blank=True),
        ),
        migrations.AddField(
            model_name='batch',
            name='delivery_next_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='batch',
            name='delivery_status',
            field=models.CharField(blank=True, choices=[('pending', 'Pending'), ('delivered', 'Delivered'), ('failed', 'Failed')], max_length=10),
        ),
        migrations.AddField(
            model_name='batch',
            name='output_prefix',
            field=models.CharField(blank=True, max_length=1100),
        ),
        migrations.AddField(
            model_name='file',
            name='source',
            field=models.CharField(blank=True, max_length=1100),
        ),
        migrations.AddField(
            model_name='file',
            name='source_credentials',
            field=models.CharField(blank=True, max_length=50),
        ),
        migrations.AddField(
            model_name='file',
            name='source_etag',
            field=models.CharField(blank=True, max_length=200),
        ),
        migrations.AddField(
            model_name='file',
            name='source_modified',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='StorageGrant',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('prefix', models.CharField(help_text="s3://bucket/folder/ (ending with '/'), or s3://bucket/ for the whole bucket.", max_length=1100)),
                ('read', models.BooleanField(default=True, help_text='May register objects under the prefix as batch input files (read in place).')),
                ('write', models.BooleanField(default=False, help_text='May have batch results delivered under the prefix (output_prefix).')),
                ('credentials', models.CharField(blank=True, help_text="Empty: the storage settings' S3 endpoint and keys (BATCHWEB_S3_*). NAME: the BATCHWEB_DATA_NAME_ENDPOINT_URL, _REGION, _ACCESS_KEY_ID, _SECRET_ACCESS_KEY and _PATH_STYLE variables, set for every web and worker process.", max_length=50)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('group', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='auth.group')),
                ('user', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'verbose_name': 'storage grant',
                'ordering': ['prefix', 'pk'],
                'constraints': [models.CheckConstraint(condition=models.Q(models.Q(('group__isnull', True), ('user__isnull', False)), models.Q(('group__isnull', False), ('user__isnull', True)), _connector='OR'), name='storage_grant_user_or_group')],
            },
        ),
    ]
