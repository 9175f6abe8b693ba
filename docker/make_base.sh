#!/bin/sh
# Build a Python base image from a Debian root filesystem, for hosts where python:3.11-slim cannot be
# pulled (no image registry reachable, only Debian's package mirror). Needs root, mmdebstrap (or
# debootstrap) and a Docker engine (DOCKER_HOST is honoured).
#
#   docker/make_base.sh [TAG]        default TAG: shardps-base:bookworm
#   then: docker build --build-arg BASE_IMAGE=shardps-base:bookworm ...
#
# mmdebstrap where it is installed: it unpacks with apt and dpkg in one pass and streams the tarball straight
# into `docker import`, on half of debootstrap's CPU (docs/deployment.md); debootstrap otherwise.
set -eu
tag=${1:-shardps-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Python 3.11 with venv (the images install into a virtual environment) and the CA certificates.
packages=python3,python3-venv,ca-certificates
import_image() {
    docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        -c 'CMD ["python3"]' - "$tag"
}
if command -v mmdebstrap >/dev/null 2>&1; then
    # What an image needs no more is never written: documentation, manuals, translations (dpkg's path
    # excludes; copyright files stay); apt's lists and caches are cleaned by mmdebstrap itself.
    # (sh has no pipefail: a failed mmdebstrap is noted in a file, and what was imported of it removed.)
    failed=$(mktemp)
    trap 'rm -f "$failed"' EXIT INT TERM
    # The merged-/usr hook merges /usr as debootstrap does; without it apt brings usrmerge, and with it perl.
    hooks=/usr/share/mmdebstrap/hooks/merged-usr
    [ -d "$hooks" ] && set -- --hook-dir="$hooks" || set --
    { mmdebstrap --quiet --variant=minbase --include="$packages" "$@" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm - "$mirror" || echo "mmdebstrap failed" >"$failed"; } | import_image
    if [ -s "$failed" ]; then
        docker rmi -f "$tag" >/dev/null 2>&1 || true
        echo "make_base: mmdebstrap failed" >&2
        exit 1
    fi
    exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT INT TERM
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >&2
# What an image needs no more once built: apt's lists and caches, documentation, translations.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/info/* "$root"/usr/share/locale/*
tar -C "$root" -c . | import_image
