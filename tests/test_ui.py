"""The web page (GET /), in a real browser: Debian's Chromium, driven by Playwright, against a real
server on the real tiny models. The chat (streaming, stop, edit, regenerate, model switching,
images, keys) and the operator view, and that a hostile answer stays inert text."""

from __future__ import annotations

import http.server
import io
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, sync_playwright

from fastrun_cpp.auth import KeyStore
from fastrun_cpp.default_model import embedded_model_path
from fastrun_cpp.entrypoints.ui import CONTENT_SECURITY_POLICY
from fastrun_cpp.ui import ASSETS
from tests.server import models_file, run_server, wait_until
from tests.test_batches import chat_line, jsonl

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
ECHO_TEMPLATE = Path(__file__).resolve().parent / "data" / "echo-template.jinja"
CHROMIUM = os.environ.get("FASTRUN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
STATS = re.compile(r"(\d+) tokens · [\d.]+ tokens/s · prompt (\d+) \((\d+) cached\)")
SMALL = {"slots": 2, "ctx_size": 2048, "prompt_cache_mib": 64}


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory, gemma_path, tiny_model_path, projector):
    """An open loopback server with: smol (SmolLM2, loaded), gemma (not loaded), babble (a random
    2-layer model: long answers, for stop and busy slots), echo (SmolLM2 with a template that makes
    it repeat the user's message; echo-think reads `<think>` in what it repeats as reasoning) and
    vision (Gemma with a projector, not loaded)."""
    tmp = tmp_path_factory.mktemp("ui")
    smol = str(embedded_model_path())
    models = models_file(tmp / "models.toml", [
        {"id": "smol", "path": smol, **SMALL},
        {"id": "gemma", "path": str(gemma_path), **SMALL, "slots": 1, "preload": False},
        {"id": "babble", "path": str(tiny_model_path), **SMALL, "ctx_size": 8192},
        {"id": "echo", "path": smol, **SMALL, "slots": 1, "chat_template_file": str(ECHO_TEMPLATE)},
        {"id": "echo-think", "path": smol, **SMALL, "slots": 1, "chat_template_file": str(ECHO_TEMPLATE),
         "reasoning_parser": "think", "preload": False},
        {"id": "vision", "path": str(gemma_path), "mmproj": str(projector), **SMALL, "slots": 1, "preload": False},
    ])
    with run_server("--models-file", str(models), log_dir=tmp, startup_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Browser:
    if CHROMIUM is None:
        pytest.fail("no Chromium on this machine: `make test` installs Debian's `chromium` package "
                    "(apt-get install chromium); FASTRUN_CHROMIUM names another binary")
    with sync_playwright() as playwright:
        # Chromium's sandbox cannot start as root (a CI container): it is the browser's, not the page's.
        launched = playwright.chromium.launch(executable_path=CHROMIUM,
                                              args=["--no-sandbox"] if os.geteuid() == 0 else [])
        yield launched
        launched.close()


@dataclass
class Tab:
    page: Page
    problems: list[str] = field(default_factory=list)  # console errors, page errors, dialogs
    requests: list[str] = field(default_factory=list)  # every URL the page asked for


def open_tab(browser: Browser, url: str, *, allowed: tuple[str, ...] = ()) -> Tab:
    """A fresh browser profile (no storage) on the page; `allowed`: console errors expected."""
    page = browser.new_context().new_page()
    tab = Tab(page)
    page.on("console", lambda m: m.type == "error" and not any(a in m.text for a in allowed)
            and tab.problems.append(m.text))
    page.on("pageerror", lambda e: tab.problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: (tab.problems.append(f"dialog: {d.message}"), d.dismiss()))
    page.on("request", lambda r: tab.requests.append(r.url))
    page.goto(url)
    return tab


@pytest.fixture
def tab(browser, ui_server):
    opened = open_tab(browser, ui_server.root_url + "/")
    opened.page.wait_for_selector("#model-select option", state="attached")
    yield opened
    opened.page.context.close()


def choose(page: Page, model: str) -> None:
    page.select_option("#model-select", model)


def set_sampling(page: Page, **fields: str) -> None:
    """Fill the page's sampling settings (temperature, max_tokens, ...), opening their panel."""
    page.evaluate("() => { document.getElementById('settings').open = true; }")
    for name, value in fields.items():
        page.fill("#" + name.replace("_", "-"), value)


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_for_answers(page: Page, count: int, timeout_s: float = 300) -> None:
    """Until `count` answers have ended (an ended answer shows its stats and the send button is back)."""
    page.wait_for_function(
        """count => document.querySelectorAll('.msg.assistant').length === count
                    && !document.querySelector('.msg.assistant:last-child .stats:empty')
                    && !document.getElementById('send').hidden""", arg=count, timeout=timeout_s * 1000)


def last_answer(page: Page) -> str:
    return page.inner_text(".msg.assistant:last-child .content")


def last_stats(page: Page) -> str:
    return page.inner_text(".msg.assistant:last-child .stats")


def busy_slots(server, model: str) -> int:
    return server.health()["models"][model].get("busy_slots", 0)


# ---------------------------------------------------------------- served as it should be


def test_the_page_and_its_files_come_from_the_server_with_a_strict_csp(ui_server):
    page = httpx.get(ui_server.root_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY and "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    # Everything the page loads is this server's: no CDN, font or script from elsewhere.
    for text in (page.text, (ASSETS / "app.js").read_text(), (ASSETS / "app.css").read_text()):
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I)
    imports = re.findall(r'^import .* from "([^"]+)";$', (ASSETS / "app.js").read_text(), re.M)
    assert imports and all(url.startswith("./vendor/") for url in imports)
    loaded = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert loaded and all(url.startswith("/ui/") or url.startswith("data:") for url in loaded), loaded
    for path in [url for url in loaded if url.startswith("/ui/")] + ["/ui/vendor/markdown-it.mjs",
                                                                      "/ui/vendor/purify.mjs"]:
        asset = httpx.get(ui_server.root_url + path, timeout=10)
        assert asset.status_code == 200, path
        assert asset.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        again = httpx.get(ui_server.root_url + path, headers={"If-None-Match": asset.headers["etag"]}, timeout=10)
        assert again.status_code == 304
    # Only the page's own files: no path from a request reaches the file system.
    for path in ("/ui/../../pyproject.toml", "/ui/%2e%2e/%2e%2e/pyproject.toml", "/ui/vendor/../../ui.py",
                 "/ui/", "/ui/nothing.js"):
        assert httpx.get(ui_server.root_url + path, timeout=10).status_code == 404, path


def test_no_ui_serves_no_page_and_the_same_api(tmp_path):
    with run_server("--no-ui", "--slots", "1", "--ctx-size", "512", log_dir=tmp_path) as server:
        assert httpx.get(server.root_url + "/", timeout=10).status_code == 404
        assert httpx.get(server.root_url + "/ui/app.js", timeout=10).status_code == 404
        assert httpx.get(server.base_url + "/models", timeout=10).status_code == 200


def test_the_vendored_libraries_are_their_npm_packages_byte_for_byte():
    checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "vendor_ui.py"), "--check"],
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr


# ---------------------------------------------------------------- the chat


def test_a_message_streams_an_answer_kept_in_the_browser_with_tokens_per_second_and_cached_tokens(tab, ui_server):
    page = tab.page
    # Count the answer's renders while it streams: more than one means it arrived in pieces.
    page.evaluate("""() => {
        window.renders = 0;
        new MutationObserver(() => { window.renders++; })
            .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    choose(page, "smol")
    set_sampling(page, max_tokens="48")
    send(page, "Write three sentences about the sea.")
    wait_for_answers(page, 1)
    first = STATS.search(last_stats(page))
    assert first, last_stats(page)
    assert int(first[1]) > 1 and last_answer(page).strip()
    assert page.evaluate("window.renders") > 3
    # The next turn reuses the first one's prefix: the page shows the cached tokens.
    send(page, "And one about the sky.")
    wait_for_answers(page, 2)
    second = STATS.search(last_stats(page))
    assert second and int(second[3]) > 0 and int(second[2]) > int(first[2])
    # Kept in this browser: a reload shows the conversation again.
    page.reload()
    page.wait_for_selector(".msg.assistant:nth-of-type(4)", state="attached")
    assert page.locator(".msg.user").count() == 2
    assert page.locator("#conversation-list li").count() == 1
    assert tab.problems == []


def test_edit_and_resend_and_regenerate(tab, ui_server):
    page = tab.page
    choose(page, "smol")
    set_sampling(page, max_tokens="32")  # three sampled answers: bounded, not up to the 2k-token context
    send(page, "Name a color.")
    wait_for_answers(page, 1)
    page.click(".msg.user .edit")
    page.fill(".edit-box", "Name a fruit.")
    sent = len([url for url in tab.requests if url.endswith("/chat/completions")])
    page.click(".edit-send")
    wait_for_answers(page, 1)
    assert page.inner_text(".msg.user .content") == "Name a fruit."
    page.click(".msg.assistant .regenerate")
    wait_for_answers(page, 1)
    assert page.locator(".msg").count() == 2  # the answer replaced, not added
    assert len([url for url in tab.requests if url.endswith("/chat/completions")]) == sent + 2
    assert tab.problems == []


def test_stop_ends_the_stream_and_frees_the_slot(tab, ui_server):
    page = tab.page
    choose(page, "babble")
    # Greedy: a sampled answer of random weights ends at a random token now and then (this one runs on).
    set_sampling(page, max_tokens="7000", temperature="0")
    send(page, "Go on for as long as you can.")
    assert wait_until(lambda: busy_slots(ui_server, "babble") == 1, timeout=120)
    page.wait_for_selector("#stop", state="visible")
    page.click("#stop")
    assert wait_until(lambda: busy_slots(ui_server, "babble") == 0, timeout=60), "the slot stayed busy"
    wait_for_answers(page, 1)
    assert "stopped" in last_stats(page)
    assert tab.problems == []


def test_choosing_an_unloaded_model_loads_it(tab, ui_server):
    page = tab.page
    card = httpx.get(ui_server.base_url + "/models/gemma", timeout=10).json()
    assert card["status"] == "unloaded"
    choose(page, "gemma")
    page.wait_for_function("() => document.getElementById('model-status').textContent === 'loaded'", timeout=300_000)
    assert httpx.get(ui_server.base_url + "/models/gemma", timeout=10).json()["status"] == "loaded"
    set_sampling(page, max_tokens="16")  # an answer is all this needs, not the 2k tokens Gemma may ramble
    send(page, "Hello")
    wait_for_answers(page, 1)
    assert STATS.search(last_stats(page))
    assert tab.problems == []


def test_reasoning_is_shown_apart_and_folded(tab, ui_server):
    page = tab.page
    choose(page, "echo-think")
    set_sampling(page, temperature="0")
    send(page, "<think>First I weigh the options.</think>The answer is blue.")
    wait_for_answers(page, 1)
    reasoning = page.locator(".msg.assistant details.reasoning")
    assert reasoning.count() == 1 and not reasoning.evaluate("details => details.open")  # folded
    assert "weigh the options" not in last_answer(page) and "answer is blue" in last_answer(page)
    assert "weigh the options" in reasoning.text_content()
    assert tab.problems == []


def png(size: int = 64) -> bytes:
    image = Image.new("RGB", (size, size))
    for x in range(size):
        for y in range(size):
            image.putpixel((x, y), (x * 4 % 256, y * 4 % 256, 128))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_an_attached_image_reaches_a_vision_model(tab, ui_server):
    page = tab.page
    assert page.locator("#attach-label").is_hidden()  # smol reads no images
    choose(page, "vision")
    page.wait_for_function("() => document.getElementById('model-status').textContent === 'loaded'", timeout=300_000)
    page.wait_for_selector("#attach-label", state="visible")
    text_only = httpx.post(ui_server.base_url + "/chat/completions", timeout=300, json={
        "model": "vision", "max_tokens": 1, "messages": [{"role": "user", "content": "What is this?"}]}).json()
    page.set_input_files("#attach", files=[{"name": "picture.png", "mimeType": "image/png", "buffer": png()}])
    page.wait_for_selector("#attachments img", state="visible")
    set_sampling(page, max_tokens="16")
    send(page, "What is this?")
    wait_for_answers(page, 1)
    stats = STATS.search(last_stats(page))
    assert stats and int(stats[2]) > text_only["usage"]["prompt_tokens"] + 8  # the image's tokens are in the prompt
    assert page.locator(".msg.user .images img").count() == 1
    assert tab.problems == []


# ---------------------------------------------------------------- what a model writes is untrusted


class Beacon:
    """An HTTP server that counts what reaches it: a page that loads anything from it leaked."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        beacon = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the standard library's name)
                beacon.hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def hostile(beacon: Beacon) -> str:
    return (f'Hi <img src="{beacon.url}/img" onerror="window.pwned=1"> <script>window.pwned=2</script> '
            f'![b]({beacon.url}/markdown-image.png) [c](javascript:window.pwned=3) '
            f'<a href="javascript:window.pwned=4">d</a> <iframe src="{beacon.url}/frame"></iframe> '
            '<svg onload="window.pwned=5"></svg>')


def assert_inert(tab: Tab, beacon: Beacon) -> None:
    page = tab.page
    found = page.evaluate("""() => ({
        pwned: window.pwned === undefined ? null : window.pwned,
        elements: document.querySelectorAll(
            '.msg img:not(.images img), .msg script, .msg iframe, .msg svg, .msg [onerror], .msg [onload]').length,
        scripts: document.scripts.length,
        javascriptLinks: document.querySelectorAll('a[href^="javascript" i]').length,
    })""")
    assert found == {"pwned": None, "elements": 0, "scripts": 1, "javascriptLinks": 0}, found
    assert beacon.hits == []
    assert not [url for url in tab.requests if url.startswith(beacon.url)]


def test_a_hostile_answer_renders_as_inert_text(browser, ui_server):
    beacon = Beacon()
    try:
        message = hostile(beacon)
        # The model really writes the markup back (the echo template, greedy).
        direct = httpx.post(ui_server.base_url + "/chat/completions", timeout=300, json={
            "model": "echo", "temperature": 0, "messages": [{"role": "user", "content": message}]}).json()
        said = direct["choices"][0]["message"]["content"]
        assert "<img" in said and "onerror" in said and "<script>" in said, said
        tab = open_tab(browser, ui_server.root_url + "/")
        page = tab.page
        page.wait_for_selector("#model-select option", state="attached")
        choose(page, "echo")
        set_sampling(page, temperature="0")
        send(page, message)
        wait_for_answers(page, 1)
        shown = last_answer(page)
        assert "onerror" in shown and "<script>" in shown  # shown as the text it is
        assert_inert(tab, beacon)
        # A stored conversation is as untrusted: rendered again from this browser's storage.
        stored = [{"id": "x", "title": message, "model": "echo", "updated": 0, "messages": [
            {"role": "user", "content": message},
            {"role": "assistant", "content": message + f"\n\n<img src={beacon.url}/raw onerror=window.pwned=6>",
             "reasoning": message, "error": message, "stats": {"finish_reason": message}}]}]
        page.evaluate("s => localStorage.setItem('fastrun-conversations', JSON.stringify(s))", stored)
        page.reload()
        page.wait_for_selector(".msg.assistant", state="attached")
        page.click(".msg.assistant details summary")
        assert "onerror" in page.inner_text(".msg.assistant")
        assert_inert(tab, beacon)
        assert tab.problems == []
        page.context.close()
    finally:
        beacon.close()


# ---------------------------------------------------------------- keys


def test_a_keyed_server_refuses_the_page_until_a_key_is_entered(browser, tmp_path):
    store = KeyStore(tmp_path / "keys.sqlite3")
    _, user_key = store.create_key("alice")
    _, admin_key = store.create_key("ops")
    store.set_admin("ops", True)
    with run_server("--slots", "1", "--ctx-size", "1024", log_dir=tmp_path,
                    env={"FASTRUN_KEYS_DB": str(store.path)}) as server:
        tab = open_tab(browser, server.root_url + "/", allowed=("status of 401", "status of 403"))
        page = tab.page
        page.wait_for_selector("#key-dialog[open]")
        assert page.locator("#model-select option").count() == 0
        page.fill("#key-input", "fr_" + "0" * 40)  # a wrong key: asked again
        page.click("#key-save")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", user_key)
        page.click("#key-save")
        page.wait_for_selector("#model-select option", state="attached")
        send(page, "Hello")
        wait_for_answers(page, 1)
        assert STATS.search(last_stats(page))
        # Kept for this tab's session only: never in the browser's lasting storage.
        assert user_key not in page.evaluate("JSON.stringify(localStorage)")
        assert page.evaluate("sessionStorage.getItem('fastrun-key')") == user_key
        # A user key does not open the operator view.
        page.click("#tab-server")
        page.wait_for_selector("#server-note:not([hidden])")
        assert "admin key" in page.inner_text("#server-note")
        assert page.locator("#server-body").is_hidden()
        headers = {"Authorization": f"Bearer {user_key}"}
        assert httpx.get(server.base_url + "/server/status", headers=headers, timeout=10).status_code == 403
        # An admin key does, and the view shows alice's use.
        page.click("#key-button")
        page.fill("#key-input", admin_key)
        page.click("#key-save")
        page.wait_for_selector("#server-usage tbody tr td:text-is('alice')")
        assert page.locator("#server-models tbody tr[data-model]").count() == 1
        # Another browser session starts with no key; a message sent without one ends with the refusal.
        other = open_tab(browser, server.root_url + "/", allowed=("status of 401",))
        other.page.wait_for_selector("#key-dialog[open]")
        other.page.keyboard.press("Escape")
        other.page.wait_for_selector("#key-dialog:not([open])", state="attached")
        other.page.evaluate("""() => { const o = document.createElement('option');
            o.value = o.textContent = 'HuggingFaceTB/SmolLM2-135M-Instruct'; document.getElementById('model-select').append(o); }""")
        send(other.page, "Hello")
        other.page.wait_for_selector("#key-dialog[open]")
        assert "key" in other.page.inner_text("#key-reason").lower()
        other.page.keyboard.press("Escape")
        other.page.wait_for_selector(".msg.assistant .error")
        assert "needs an API key" in other.page.inner_text(".msg.assistant .error")
        assert other.page.locator("#send").is_visible()
        assert tab.problems == [] and other.problems == []
        page.context.close()
        other.page.context.close()


# ---------------------------------------------------------------- the operator view


def test_the_operator_view_shows_a_busy_slot_while_a_stream_runs(tab, ui_server):
    page = tab.page
    page.click("#tab-server")
    row = page.locator('#server-models tbody tr[data-model="babble"]')
    row.wait_for()
    page.wait_for_selector(".uplot", state="attached")
    assert page.locator(".uplot").count() == 3
    # 8,000 tokens: seconds of a busy slot, several of the page's reads (one each 2 s). `ignore_eos`:
    # the random model's sampled answers end at a random token now and then, one in CI within 2 s.
    body = {"model": "babble", "max_tokens": 8000, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Go on."}]}
    with httpx.stream("POST", ui_server.base_url + "/chat/completions", json=body, timeout=300) as response:
        lines = response.iter_lines()
        next(lines)  # the stream has begun: the request holds a slot
        page.wait_for_function(
            """() => document.querySelector('#server-models tr[data-model="babble"] td:nth-child(3)')
                     .textContent === '1 / 2'""", timeout=60_000)
    # The client left: the slot is free again, and the view says so.
    page.wait_for_function(
        """() => document.querySelector('#server-models tr[data-model="babble"] td:nth-child(3)')
                 .textContent === '0 / 2'""", timeout=60_000)
    # A background response at work is listed with its status.
    with httpx.Client(base_url=ui_server.base_url, timeout=60) as http:
        response = http.post("/responses", json={"model": "babble", "input": "Go on.", "background": True,
                                                 "max_output_tokens": 8000, "ignore_eos": True}).json()
        try:
            page.wait_for_selector(f'#server-background tbody tr:has(td:text-is("{response["id"]}"))')
        finally:
            http.post(f"/responses/{response['id']}/cancel")
    page.wait_for_selector(f'#server-background tbody tr:has(td:text-is("{response["id"]}"))', state="detached",
                           timeout=120_000)
    # A batch at work is listed with its progress.
    lines = jsonl([chat_line(f"line-{i}", "Go on.", max_tokens=7000, model="babble", ignore_eos=True) for i in range(2)])
    with httpx.Client(base_url=ui_server.base_url, timeout=60) as http:
        uploaded = http.post("/files", files={"file": ("lines.jsonl", lines)}, data={"purpose": "batch"}).json()
        batch = http.post("/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"}).json()
        try:
            cell = page.locator(f'#server-batches tbody tr:has(td:text-is("{batch["id"]}")) td:nth-child(3)')
            cell.wait_for()
            assert cell.inner_text() in ("validating", "in_progress", "finalizing")
            assert "/ 2" in page.locator(f'#server-batches tbody tr:has(td:text-is("{batch["id"]}")) '
                                         'td:nth-child(5)').inner_text()
        finally:
            http.post(f"/batches/{batch['id']}/cancel")
    page.wait_for_selector(f'#server-batches tbody tr:has(td:text-is("{batch["id"]}"))', state="detached",
                           timeout=120_000)
    assert tab.problems == []
