"""Storage grants: which objects of their own buckets a user may name, in one rule for every
path that does (a file registered by reference reads, and every later read of it checks
again: `check_source_readable`; a batch's output_prefix writes).

A name is reachable when it is a well-formed `s3://` name (jobs.storage.external's rule:
no other scheme, no `..` or `.` segments, no empty segments), lies outside the service's
own storage, and lies under a prefix granted to the user or to one of their groups for
that access. The service then reaches it with the grant's credential set: the storage
settings' keys or a named set, never anything the user sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from django.db.models import Q

from jobs.lib.errors import ServiceError
from jobs.models import File, StorageGrant
from jobs.storage.external import S3Location, inside_own_storage, parse_s3_url

Access = Literal["read", "write"]


@dataclass(frozen=True)
class Reach:
    """A name the user may use, and the credential set the service reaches it with."""

    location: S3Location
    credentials: str


def granted(*, owner: Any, access: Access) -> list[tuple[S3Location, str]]:
    """The prefixes granted to `owner` (directly or through a group) for `access`, with
    their credential sets, the longest first (the most specific grant decides)."""
    rows = StorageGrant.objects.filter(Q(user=owner) | Q(group__in=owner.groups.all()),
                                       **{access: True}).values_list("prefix", "credentials")
    prefixes = []
    for prefix, credentials in rows:
        try:
            prefixes.append((parse_s3_url(prefix, folder=True), credentials))
        except ValueError:  # a malformed row (the admin refuses them): it grants nothing
            continue
    return sorted(prefixes, key=lambda item: len(item[0].key), reverse=True)


def reach(*, owner: Any, url: Any, access: Access, param: str, folder: bool) -> Reach:
    """The granted place `url` names (an object, or a folder when `folder`), or a
    ServiceError (400) naming `param`: a malformed or non-s3 name, the service's own
    storage, or a place no grant of the user's opens for `access`."""
    try:
        location = parse_s3_url(url, folder=folder)
    except ValueError as exc:
        raise ServiceError(f"{param} {exc}.", param=param, code="invalid_storage_url") from None
    if not inside_own_storage(location):
        for prefix, credentials in granted(owner=owner, access=access):
            if location.within(prefix):
                return Reach(location, credentials)
    mine = [prefix.url for prefix, _ in granted(owner=owner, access=access)][:5]
    raise ServiceError(
        f"{param}: {location.url[:300]} is not under a prefix you may {access}"
        + (f" (prefixes you may {access}: {', '.join(mine)})." if mine
           else "; ask an operator for a storage grant."),
        param=param, code="storage_not_granted")


def check_source_readable(*, file: File, param: str) -> None:
    """Every reader of a file registered by reference (`File.source`) checks this first: a
    batch created on it, a rerun of its batch, its download (API and dashboard), its
    check, a copy of it (an eval set, another model's input). It is read with the
    service's credentials only while a grant still lets its owner read there, so an
    operator's revocation stops every new read (a batch already running keeps its input).
    A ServiceError (400) naming `param` otherwise; a stored file passes."""
    if file.source:
        reach(owner=file.owner, url=file.source, access="read", param=param, folder=False)


def check_output_prefix(*, owner: Any, value: Any) -> str:
    """A batch's `output_prefix`: "" when none is asked for, else the granted folder it
    names (results are written there as <prefix><batch_id>_output.jsonl and
    _errors.jsonl)."""
    if value in (None, ""):
        return ""
    return reach(owner=owner, url=value, access="write", param="output_prefix",
                 folder=True).location.url
