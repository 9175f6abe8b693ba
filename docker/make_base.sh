#!/bin/sh
# Build a Python base image from a Debian root filesystem, for hosts where python:3.11-slim cannot be
# pulled (no image registry reachable, only Debian's package mirror). Needs root, debootstrap and a
# Docker engine (DOCKER_HOST is honoured).
#
#   docker/make_base.sh [TAG]        default TAG: shardps-base:bookworm
#   then: docker build --build-arg BASE_IMAGE=shardps-base:bookworm ...
set -eu
tag=${1:-shardps-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT INT TERM
# Python 3.11 with venv (the images install into a virtual environment) and the CA certificates.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >&2
# What an image needs no more once built: apt's lists and caches, documentation, translations.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/info/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    -c 'CMD ["python3"]' - "$tag"
