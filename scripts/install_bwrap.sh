#!/bin/sh
# Install bubblewrap, the sandbox `zeroedu grade` runs every submission in. Always exits 0: where it cannot
# install, it says why, and `zeroedu grade` then refuses untrusted notebooks (tests that need it skip).
if command -v bwrap >/dev/null 2>&1; then
    echo "install_bwrap: bubblewrap is already installed ($(command -v bwrap))"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"; else
    echo "install_bwrap: not root and no password-less sudo: install the package bubblewrap yourself"
    exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get install -y bubblewrap >/dev/null 2>&1 || \
        { $SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y bubblewrap >/dev/null 2>&1; }
elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y bubblewrap >/dev/null 2>&1
elif command -v apk >/dev/null 2>&1; then
    $SUDO apk add bubblewrap >/dev/null 2>&1
elif command -v brew >/dev/null 2>&1; then
    echo "install_bwrap: macOS has no bubblewrap (it needs Linux namespaces): grade on Linux, or use --trusted"
    exit 0
else
    echo "install_bwrap: no apt-get, dnf or apk here: install the package bubblewrap yourself"
    exit 0
fi
if command -v bwrap >/dev/null 2>&1; then
    echo "install_bwrap: installed $(bwrap --version 2>/dev/null)"
else
    echo "install_bwrap: the package manager could not install bubblewrap (offline?): zeroedu grade will refuse untrusted notebooks"
fi
exit 0
