from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Batch jobs"

    def ready(self) -> None:
        # Django streams large uploads into FILE_UPLOAD_TEMP_DIR and fails if it is
        # missing; settings only name it (they create nothing on import).
        from jobs.storage.backends import check_at_start
        from jobs.storage.temp import temp_dir

        temp_dir()
        # A wrong S3 endpoint, bucket or credentials stops every process at start, naming
        # the setting (a filesystem storage checks nothing here).
        check_at_start()
