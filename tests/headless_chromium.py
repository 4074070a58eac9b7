"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages,
each ended by a NUL byte, read on fd 3 and written on fd 4), so no client package is needed: open a page at a given
viewport, evaluate JavaScript in it, take a screenshot."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    """The first Chromium on PATH (Debian: ``apt-get install -y chromium``), or None."""
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def _above_9(fd: int) -> int:
    """``fd`` moved to the lowest free number above 9 (close-on-exec, as os.pipe opens it)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Chromium:
    """One headless browser; ``with Chromium() as browser: browser.open(url, width)``."""

    def __init__(self, binary: str | None = None, timeout: float = 60.0):
        self.binary = binary or chromium_binary()
        if self.binary is None:
            raise FileNotFoundError(f"no Chromium on PATH (looked for {', '.join(BINARIES)})")
        self.timeout = timeout
        self._next_id = 0
        self._buffer = b""
        self._events: list[dict] = []

    def __enter__(self):
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        # the browser's ends of the two pipes, numbered above 9 so that bash can put them on fds 3 and 4
        to_browser_r, self._to_browser = (_above_9(fd) for fd in os.pipe())
        self._from_browser, from_browser_w = (_above_9(fd) for fd in os.pipe())
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                 f"--user-data-dir={self._profile}", "about:blank"]
        redirect = f"3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-"
        self._proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" {redirect}', self.binary, *flags],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      pass_fds=(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close")
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- protocol ------------------------------------------------------------------------------------------
    def _read_message(self) -> dict:
        import select

        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], self.timeout)
            if not ready:
                raise TimeoutError(f"Chromium sent nothing for {self.timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed its pipe (exit code {self._proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept for :meth:`wait_for`)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_for(self, event: str, session: str) -> dict:
        while True:
            for i, message in enumerate(self._events):
                if message.get("method") == event and message.get("sessionId") == session:
                    return self._events.pop(i)
            self._events.append(self._read_message())

    # -- pages ---------------------------------------------------------------------------------------------
    def open(self, url: str, width: int, height: int = 900) -> Page:
        """A new tab showing ``url`` at a ``width`` x ``height`` CSS-pixel viewport, loaded (fonts included)."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        self.send("Page.enable", session)
        self.send("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired", session)
        page = Page(self, session, target)
        page.evaluate("document.fonts.ready.then(() => true)")
        return page


class Page:
    def __init__(self, browser: Chromium, session: str, target: str):
        self.browser, self.session, self.target = browser, session, target

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (a promise is awaited), as JSON."""
        result = self.browser.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True,
                                   awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (the whole length with ``full_page``) at the viewport's width."""
        params = {}
        if full_page:
            metrics = self.browser.send("Page.getLayoutMetrics", self.session)
            width, height = metrics["cssLayoutViewport"]["clientWidth"], metrics["cssContentSize"]["height"]
            params = {"captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height,
                                                              "scale": 1}}
        data = self.browser.send("Page.captureScreenshot", self.session, format="png", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self.browser.send("Target.closeTarget", targetId=self.target)
