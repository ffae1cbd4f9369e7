"""Where bytes live, below every service: nothing here knows a batch or changes a row.

- `backends`: one interface over the filesystem and S3-compatible object storage.
- `objects`: one stored object by name: a new name, a local file saved, a range read, a
  download link.
- `lines`: stored bytes read line by line, streamed, never a whole file in memory.
- `line_index`: a grouped batch's index of where each line it runs sits in its input.
- `temp`: local temporary files.
- `external`: objects of users' own buckets (data by reference): the rule of their
  `s3://` names, reads pinned to a registered version, streamed writes.
"""
