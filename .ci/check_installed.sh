#!/bin/sh
# After the installers: CI must have what they install, or fail here, before any test (the tests that need them
# fail too under CI=true, tests/conftest.py). The installers exit 0 whatever happens, for people's own machines.
status=0
if ! command -v bwrap >/dev/null 2>&1; then
    echo "CI: bubblewrap (bwrap) is not installed, so the grader's sandbox tests cannot run: see scripts/install_bwrap.sh"
    status=1
else
    user=""; [ "$(id -u)" -eq 0 ] || user="--unshare-user"
    # shellcheck disable=SC2086
    if ! out=$(bwrap --ro-bind / / --dev /dev --proc /proc --unshare-net --unshare-pid --die-with-parent $user \
            -- /bin/true 2>&1); then
        echo "CI: bubblewrap is installed but cannot create a sandbox here: $out"
        status=1
    fi
fi
chromium="${ZEROEDU_CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$chromium" ]; then
    echo "CI: no Chromium at $chromium, so the browser test cannot run: see scripts/install_chromium.sh"
    status=1
fi
exit $status
