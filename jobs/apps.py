from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Batch jobs"

    def ready(self) -> None:
        # Django streams large uploads into FILE_UPLOAD_TEMP_DIR and fails if it is
        # missing; settings only name it (they create nothing on import).
        from jobs.services.files import temp_dir

        temp_dir()
