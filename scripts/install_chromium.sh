#!/usr/bin/env bash
# Install Debian's chromium for tests/test_browser.py (the real-browser JupyterLab test) and tests/test_book.py
# (the web book; fonts-noto-cjk renders its Chinese pages and PDF, poppler-utils reads the PDF back).
# Idempotent and quiet; always exits 0: where it cannot install, it says why and the browser test skips.
# Playwright drives this system browser through executable_path, so no browser is ever downloaded.
set -u

CHROMIUM="${ZEROEDU_CHROMIUM:-/usr/bin/chromium}"

if [ -x "$CHROMIUM" ] && { [ -n "${ZEROEDU_CHROMIUM:-}" ] || { command -v pdftotext >/dev/null 2>&1 && \
        fc-list 2>/dev/null | grep -qi "noto.*cjk"; }; }; then
    exit 0  # already there (with the CJK fonts and pdftotext the book test uses): nothing to say
fi
if [ -n "${ZEROEDU_CHROMIUM:-}" ]; then
    echo "install_chromium: ZEROEDU_CHROMIUM=$ZEROEDU_CHROMIUM is not an executable: fix the path or unset it" \
         "to use Debian's /usr/bin/chromium; until then the browser test skips."
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_chromium: $CHROMIUM is absent and this is not root: the browser test will skip." \
         "To run it: sudo apt-get install chromium (Debian/Ubuntu), or set ZEROEDU_CHROMIUM to a Chromium binary."
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get here: install Chromium with this system's package manager" \
         "and set ZEROEDU_CHROMIUM to its path; until then the browser test skips."
    exit 0
fi

echo "install_chromium: installing Debian's chromium with apt-get (once; about a minute)..."
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
# bounded: a network that drops packets must not hold CI for its whole budget (a fresh install takes ~1.5 min)
install() { timeout 900 apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core fonts-noto-cjk poppler-utils >>"$log" 2>&1; }
# a fresh container has empty package lists, an old one stale ones: update when the first try fails
if (install || { timeout 600 apt-get update -qq >>"$log" 2>&1; install; }) && [ -x "$CHROMIUM" ]; then
    echo "install_chromium: installed $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")."
else
    echo "install_chromium: apt-get could not install chromium (last lines below); the browser test will skip."
    tail -n 5 "$log"
fi
rm -f "$log"
exit 0
