#!/bin/sh
# The official postgres image's start, for the stand-in: on an empty data directory, a
# cluster whose superuser is POSTGRES_USER with POSTGRES_PASSWORD (scram-sha-256 over TCP)
# and a database POSTGRES_DB; then the server as the postgres user, listening on all
# addresses of the container.
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
as_postgres() { setpriv --reuid=postgres --regid=postgres --clear-groups "$@"; }

mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
        --auth-local=peer --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\" OWNER \"$user\";" \
            | as_postgres postgres --single -D "$PGDATA" -j postgres >/dev/null
    fi
fi
[ "$1" = postgres ] && shift
exec setpriv --reuid=postgres --regid=postgres --clear-groups postgres -D "$PGDATA" "$@"
