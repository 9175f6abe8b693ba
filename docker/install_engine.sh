#!/bin/sh
# Install what the container test (tests/test_containers.py) needs, where it is missing: Debian's
# docker.io (dockerd and the docker CLI), docker-compose 1.29, and mmdebstrap and debootstrap (the offline base
# image: docker/make_base.sh uses mmdebstrap where it is installed). Needs root and apt-get;
# elsewhere it only says what is missing, and the test skips with that reason.
set -eu
need=""
command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || need="$need docker.io"
command -v docker-compose >/dev/null 2>&1 || need="$need docker-compose"
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need="$need debootstrap"
command -v mmdebstrap >/dev/null 2>&1 || need="$need mmdebstrap"
[ -z "$need" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_engine: missing$need (install them as root with apt-get); the container test will skip" >&2
    exit 0
fi
echo "install_engine: apt-get install$need" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need iptables >/dev/null; }; then
    echo "install_engine: apt-get install$need failed; the container test will skip" >&2
fi
