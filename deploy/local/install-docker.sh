#!/bin/sh
# Docker on a Debian 12 (bookworm) host from Debian's own packages: the engine (docker.io),
# and `docker compose` and buildx, which bookworm does not package, from Debian 13's
# docker-compose and docker-buildx (static Go programs that need only the C library),
# fetched with apt-get from a source list of their own (the host's sources are left as
# they are). Also debootstrap, which deploy/local/build-bases.sh uses. Needs root; does
# nothing that is already done. It installs; it does not start dockerd.
set -eu
export DEBIAN_FRONTEND=noninteractive
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q
    apt-get install -y -q docker.io debootstrap
fi
if ! docker compose version >/dev/null 2>&1 || ! docker buildx version >/dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial" "$work/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        > "$work/sources.list"
    apt_opts="-oDir::State::Lists=$work/lists -oDir::Etc::SourceList=$work/sources.list
              -oDir::Etc::SourceParts=/dev/null -oAPT::Sandbox::User=root"
    # shellcheck disable=SC2086
    apt-get $apt_opts update -q
    # shellcheck disable=SC2086
    (cd "$work/debs" && apt-get $apt_opts download docker-compose docker-buildx)
    dpkg -i "$work"/debs/*.deb
fi
docker compose version
