#!/bin/sh
# The S3-compatible store of the compose deployment: SeaweedFS (`weed server -s3`), one
# identity with the service's keys, and the service's bucket created once the server is up.
# (MinIO's community images are no longer published.) Runs in the chrislusf/seaweedfs image.
set -eu
: "${S3_ACCESS_KEY_ID:?}" "${S3_SECRET_ACCESS_KEY:?}" "${S3_BUCKET:?}"

umask 077
cat > /tmp/s3.json <<JSON
{"identities": [{"name": "batchweb",
  "credentials": [{"accessKey": "${S3_ACCESS_KEY_ID}", "secretKey": "${S3_SECRET_ACCESS_KEY}"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON

weed server -dir=/data -s3 -s3.port=8333 -s3.config=/tmp/s3.json &
server=$!
trap 'kill -TERM "$server"; wait "$server"; exit 0' TERM INT

# `weed shell` talks to the master on localhost:9333; creating a bucket that exists is a
# harmless error, so this simply repeats until the bucket is listed.
until echo "s3.bucket.list" | weed shell 2>/dev/null | grep -qw "${S3_BUCKET}"; do
    echo "s3.bucket.create -name ${S3_BUCKET}" | weed shell >/dev/null 2>&1 || true
    sleep 2
done
echo "seaweedfs: bucket ${S3_BUCKET} ready on :8333"
wait "$server"
