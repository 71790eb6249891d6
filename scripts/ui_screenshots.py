#!/usr/bin/env python3
"""Screenshots of the web page for the docs (docs/images/ui-chat.png, ui-server.png): a real
server on the embedded model, a real answer, and the operator view while clients keep it busy.

    .venv/bin/python scripts/ui_screenshots.py   # Chromium as tests/test_ui.py finds it
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server import DEFAULT_MODEL, run_server  # noqa: E402

OUT = ROOT / "docs" / "images"
QUESTION = "Show me a Python function that reverses a string, and explain it in two sentences."


def keep_busy(server, stop: threading.Event) -> None:
    topics = ["the sea", "mountains", "rivers", "forests", "deserts", "cities"]
    i = 0
    while not stop.is_set():
        httpx.post(server.base_url + "/chat/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "max_tokens": 40,
            "messages": [{"role": "system", "content": "You are a concise assistant."},
                         {"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}]})
        i += 1


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    chromium = os.environ.get("FASTRUN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    with tempfile.TemporaryDirectory() as tmp, \
            run_server("--slots", "4", "--ctx-size", "2048", log_dir=Path(tmp)) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(server.root_url + "/")
        page.wait_for_selector("#model-select option", state="attached")
        page.click("#settings summary")
        page.fill("#system-prompt", "You are a helpful programming assistant.")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "200")
        page.click("#settings summary")
        page.fill("#prompt", QUESTION)
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .regenerate", timeout=300_000)
        page.screenshot(path=str(OUT / "ui-chat.png"))
        stop = threading.Event()
        clients = [threading.Thread(target=keep_busy, args=(server, stop)) for _ in range(3)]
        for client in clients:
            client.start()
        page.click("#tab-server")
        time.sleep(40)  # a picture of the last 40 s: what the charts draw
        page.screenshot(path=str(OUT / "ui-server.png"))
        stop.set()
        for client in clients:
            client.join()
        browser.close()


if __name__ == "__main__":
    main()
