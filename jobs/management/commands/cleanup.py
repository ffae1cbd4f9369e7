"""`manage.py cleanup [--dry-run]`: delete expired files, stale upload parts, merged shard
parts and orphaned storage objects (see `jobs.services.cleanup`). Runs on its own schedule
inside the workers too; this command is for running it now or from an external cron."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from jobs.services.cleanup import run_cleanup


class Command(BaseCommand):
    help = "Delete expired files, stale upload parts and orphaned storage objects."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="List what would be deleted; delete nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        report = run_cleanup(dry_run=options["dry_run"])
        verb = "would delete" if report.dry_run else "deleted"
        verbose = options["verbosity"] >= 2
        sections = [
            ("expired files", report.expired_files),
            ("upload parts", report.upload_parts),
            ("merged shard parts", report.merged_parts),
            ("orphaned objects", report.orphans),
        ]
        for label, items in sections:
            self.stdout.write(f"{verb} {len(items)} {label}")
            if verbose:
                for item in items:
                    self.stdout.write(f"  {item}")
        if report.expired_uploads:
            self.stdout.write(f"{'would expire' if report.dry_run else 'expired'} "
                              f"{len(report.expired_uploads)} pending uploads")
        if report.archived_batches:
            self.stdout.write(f"archived {report.archived_batches} message batches whose "
                              "results expired")
        if report.kept_in_use:
            self.stdout.write(f"kept {len(report.kept_in_use)} expired files still read by "
                              f"active batches: {', '.join(report.kept_in_use)}")
