"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ending in
NUL on file descriptors 3 and 4), with nothing but the standard library: no driver or browser is downloaded. Debian's
`chromium` package is the browser; `BROWSER` is where it is looked for.

A page opened keeps what a test asserts on: console messages and uncaught exceptions, the browser's own error log
entries, and every URL the page requested."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSER = os.environ.get("HARNESS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-default-apps", "--disable-extensions", "--disable-sync",
         "--no-first-run", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
         "--window-size=1280,900", "--remote-debugging-pipe")


def available() -> bool:
    return os.access(BROWSER, os.X_OK)


@dataclass
class Seen:
    """What a page did while it was open."""

    console: list[tuple[str, str]] = field(default_factory=list)  # (type, text)
    exceptions: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return ([f"console.{kind}: {text}" for kind, text in self.console if kind in ("error", "assert")]
                + [f"uncaught: {e}" for e in self.exceptions] + [f"browser log: {e}" for e in self.log_errors])


class Browser:
    """One Chromium process; `open(url)` a page in it. A context manager: the process is gone after the block."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="harness-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire() -> None:  # in the child: its fd 3 reads our messages, fd 4 writes its own
            a, b = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        # its log to a file: a pipe nobody reads until it exits would block it once full
        self._log = open(os.path.join(self.profile, "chromium.log"), "w+b")
        self.proc = subprocess.Popen([BROWSER, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     preexec_fn=wire, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self._events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"chromium sent nothing within {self.timeout_s:.0f}s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"chromium closed its pipe (exit {self.proc.poll()}): {err}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            m = self._read(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self._events.append(m)

    def pump(self, seconds: float) -> None:
        """Take in the events the browser sends for a while."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._events.append(self._read(deadline))
            except TimeoutError:
                return

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Network", "Page", "Log"):
            self.call(f"{domain}.enable", session=session)
        page = Page(self, session)
        self.call("Page.navigate", {"url": url}, session=session)
        page.wait_for("document.readyState === 'complete'")
        return page


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session
        self._seen = Seen()

    @property
    def seen(self) -> Seen:
        """Everything the page's session reported so far."""
        events = self.browser._events
        self.browser._events = [e for e in events if e.get("sessionId") != self.session]
        for e in events:
            if e.get("sessionId") != self.session:
                continue
            p = e.get("params", {})
            method = e.get("method")
            if method == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                self._seen.console.append((p.get("type", ""), text))
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                self._seen.exceptions.append(d.get("exception", {}).get("description") or d.get("text", ""))
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                self._seen.log_errors.append(p["entry"].get("text", ""))
            elif method == "Network.requestWillBeSent":
                self._seen.requests.append(p.get("request", {}).get("url", ""))
        return self._seen

    def evaluate(self, expression: str) -> Any:
        """The expression's value in the page (awaited where it is a promise), as JSON."""
        r = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                   "awaitPromise": True}, session=self.session)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]}: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} not true within {timeout_s:.0f}s")
            self.browser.pump(0.05)

    def screenshot(self, path: Path, width: int = 1280, height: int | None = None) -> Path:
        """A PNG of the page: the whole page's height, or `height` CSS pixels of it."""
        full = height or int(self.evaluate("document.documentElement.scrollHeight"))
        self.browser.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": full,
                                                                 "deviceScaleFactor": 1, "mobile": False},
                          session=self.session)
        data = self.browser.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False},
                                 session=self.session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
