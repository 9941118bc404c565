#!/bin/sh
# Installs headless Chromium (Debian's package), in which tests/test_report.py renders OUT/report.html.
# One apt-get line: 16 s on the 2-core CI VM (Debian 12: chromium, chromium-common and 23 libraries;
# 11 s for the two chromium packages alone, 113 MB). Idempotent and instant when it is present. Where it
# cannot install (not root, no apt-get) it says why and exits 0: those tests then skip, or fail under
# CI=true, with the same reason.
set -eu

for binary in chromium chromium-browser; do
    command -v "$binary" >/dev/null 2>&1 && exit 0
done
if [ "$(id -u)" != 0 ]; then
    echo "install_chromium: not root, so not installing chromium; report rendering tests will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get, so not installing chromium; report rendering tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-cache policy chromium 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    echo "install_chromium: no apt candidate for chromium; running apt-get update" >&2
    apt-get update -q || echo "install_chromium: apt-get update failed" >&2
fi
echo "install_chromium: installing chromium" >&2
if ! apt-get install -y -q --no-install-recommends chromium; then
    echo "install_chromium: apt-get install chromium failed; report rendering tests will skip (or fail under CI=true)" >&2
fi
exit 0
