"""Claude Code and Codex CLI as installed from npm (the versions `make setup-test` pins), run
headless against a real server: every HTTP request they make gets a 2xx, each CLI exits 0 with
an answer, and an agent's next turn reuses the prompt its last turn left in the cache: in the
same slot, in another slot (from the host tier) and after a restart (from the disk tier).

The CLIs send their own requests: a ~12k-token prompt with a dozen tools for Claude Code, the
Responses API with namespace and hosted tools, `store: false` and `prompt_cache_key` for Codex.
The only settings are docs/coding-agents.md's: where the server is, the key, the model, and (for a 32k
context) Claude Code's output and context caps, Codex's model catalog, and the server's cap on
answers that name none.

The model is SmolLM2-135M, trained on 8k tokens: served with a 32k context its positions are
YaRN-scaled (`rope_scaling = "auto"`), and what it says to Claude Code's 12k-token prompt is
readable, but it rarely ends a turn by itself. Claude Code gives up on an answer cut at its
output cap four times in a row (exit 1), so the registry ends the model's answers where a line
ends (Ollama's `PARAMETER stop`) and samples greedily: each turn then gets an answer that ends."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server import DEFAULT_MODEL, RunningServer, run_server, wait_until
from tests.test_keys import create_key, keys_cli

AGENTS = Path(sys.prefix) / "agents" / "node_modules" / ".bin"
CLAUDE, CODEX = AGENTS / "claude", AGENTS / "codex"
# docs/coding-agents.md's setup for agents on a small model: a 32k context, and answers capped where the
# client names no cap (Codex never does; Claude Code's is CLAUDE_CODE_MAX_OUTPUT_TOKENS); and
# answers that end (see above).
def agent_registry(model_id: str, source: str = "") -> str:
    """The registry entry for `model_id` (`source`: its path and mmproj lines, if any)."""
    return f"""
[[models]]
id = "{model_id}"
{source}
slots = 2
ctx_size = 32768
[models.defaults]
max_tokens = 200
temperature = 0
stop = ["\\n"]
"""


REGISTRY = agent_registry(DEFAULT_MODEL)
CLI_TIMEOUT_S = 900
REUSED = 0.95  # of the last turn's prompt, cached on the next


@pytest.fixture(scope="module", autouse=True)
def installed_clis():
    missing = [str(path) for path in (CLAUDE, CODEX) if not path.exists()]
    if missing:
        pytest.fail(f"agent CLIs not installed ({', '.join(missing)}): run `make setup-test`")


@dataclass
class Served:
    """The requests one CLI run made, from the server's access log."""

    requests: list[dict]

    def generations(self) -> list[dict]:
        return [r for r in self.requests if r["path"] in ("/v1/messages", "/v1/responses")]


def access_log(server: RunningServer, since: int) -> list[dict]:
    lines = server.log().splitlines()[since:]
    entries = [json.loads(line.split("fastrun_cpp.access: ", 1)[1]) for line in lines if "fastrun_cpp.access: " in line]
    return [entry for entry in entries if entry["path"] not in ("/ready", "/health")]


def run_cli(server: RunningServer, command: list[str], env: dict[str, str], cwd: Path,
            stdin: str | None = None) -> tuple[str, Served]:
    start = len(server.log().splitlines())
    result = subprocess.run(command, env={"PATH": os.environ["PATH"], **env}, cwd=cwd, capture_output=True,
                            text=True, timeout=CLI_TIMEOUT_S, input=stdin,
                            stdin=subprocess.DEVNULL if stdin is None else None)
    served = Served(access_log(server, start))
    if result.returncode != 0:
        pytest.fail(f"{command[:3]} exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
                    f"stderr:\n{result.stderr[-2000:]}\nrequests: {served.requests}", pytrace=False)
    assert served.generations(), ("no generation request reached the server", result.stdout[-2000:])
    refused = [r for r in served.requests if not 200 <= r["status"] < 300]
    assert not refused, refused
    return result.stdout, served


def assert_reuses(previous: Served, following: Served) -> None:
    """The following turn's first request had the previous turn's last prompt cached."""
    last_prompt = previous.generations()[-1]["prompt_tokens"]
    first = following.generations()[0]
    assert first["cached_tokens"] >= REUSED * last_prompt, (first, last_prompt)


# ---------------------------------------------------------------- Claude Code


class ClaudeCode:
    def __init__(self, home: Path, server: RunningServer, key: str, model: str = DEFAULT_MODEL) -> None:
        self.home, self.workdir = home / "claude-home", home / "claude-work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server, self.key, self.model = server, key, model

    def turn(self, prompt: str, *, resume: bool = False, image: bytes | None = None,
             stream_json: bool = False) -> tuple[dict, Served]:
        """One headless turn; with `stream_json` or an `image` (a PNG), the prompt goes in as
        Claude Code's stream-json input, a user message of the text (and the image), as its SDK
        sends one. Claude Code's system prompt is not quite the same in the two modes (its Bash
        tool's default timeout), so turns that should share a cached prefix keep to one."""
        env = {
            "HOME": str(self.home), "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
            "ANTHROPIC_BASE_URL": self.server.root_url, "ANTHROPIC_API_KEY": self.key,
            "ANTHROPIC_MODEL": self.model,
            # docs/coding-agents.md's settings for a small context window.
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1000", "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
        }
        stdin = None
        if image is None and not stream_json:
            command = [str(CLAUDE), "-p", *(["--continue"] if resume else []), prompt, "--output-format", "json"]
        else:
            command = [str(CLAUDE), "-p", *(["--continue"] if resume else []), "--input-format", "stream-json",
                       "--output-format", "stream-json", "--verbose"]
            content = [{"type": "text", "text": prompt}]
            if image is not None:
                content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                            "data": base64.b64encode(image).decode()}})
            stdin = json.dumps({"type": "user", "message": {"role": "user", "content": content}}) + "\n"
        stdout, served = run_cli(self.server, command, env, self.workdir, stdin)
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["type"] == "result" and not result["is_error"], result
        assert isinstance(result["result"], str), result
        return result, served


# ---------------------------------------------------------------- Codex CLI


class Codex:
    def __init__(self, home: Path, server: RunningServer, key: str, model: str = DEFAULT_MODEL) -> None:
        self.home, self.workdir = home / "codex-home", home / "codex-work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.key, self.model = key, model
        self.point_at(server)

    def point_at(self, server: RunningServer) -> None:
        self.server = server
        (self.home / "config.toml").write_text(f'''model = "{self.model}"
model_provider = "fastrun"

[model_providers.fastrun]
name = "fastrun-cpp"
base_url = "{server.base_url}"
model_catalog_url = "{server.base_url}/models"
env_key = "FASTRUN_API_KEY"
wire_api = "responses"
''')
        (self.home / "models_cache.json").unlink(missing_ok=True)

    def turn(self, prompt: str, *, resume: bool = False, images: tuple[Path, ...] = ()) -> tuple[list[dict], Served]:
        """One headless turn; `images` are attached to the prompt (codex exec -i)."""
        env = {"HOME": str(self.home), "CODEX_HOME": str(self.home), "FASTRUN_API_KEY": self.key}
        attached = [argument for image in images for argument in ("-i", str(image))]
        command = [str(CODEX), "exec", *(["resume", "--last"] if resume else []), *attached, "--skip-git-repo-check",
                   "--json", prompt]
        stdout, served = run_cli(self.server, command, env, self.workdir)
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        kinds = [event["type"] for event in events]
        assert "turn.completed" in kinds and "turn.failed" not in kinds, events
        messages = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
        assert messages and all(isinstance(m["text"], str) for m in messages), events
        warnings = [e["item"]["message"] for e in events if e["type"] == "item.completed"
                    and e["item"]["type"] == "error"]
        assert not [w for w in warnings if "metadata" in w], warnings  # the catalog describes the model
        return events, served


# ---------------------------------------------------------------- the runs


def server_args(directory: Path) -> tuple[str, ...]:
    registry = directory / "agents.toml"
    registry.write_text(REGISTRY)
    return "--models-file", str(registry)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A keyed server, and what it needs to be started again the same (keys, disk cache)."""
    home = tmp_path_factory.mktemp("agents")
    env = {"FASTRUN_KEYS_DB": str(home / "keys.sqlite3"), "FASTRUN_PROMPT_CACHE_DIR": str(home / "prompt-cache")}
    key = create_key(home / "keys.sqlite3", "agents")
    assert keys_cli(home / "keys.sqlite3", "admin", "agents").returncode == 0  # /health's counters
    return home, env, key


@pytest.mark.timeout(2 * CLI_TIMEOUT_S)
def test_both_agents_are_served_and_their_next_turns_are_cache_hits(keyed):
    home, env, key = keyed
    with run_server(*server_args(home), log_dir=home, env=env) as server:
        refused = httpx.get(f"{server.base_url}/models")
        assert refused.status_code == 401  # keys are on
        # Its access line is written once the response is out: wait for it, so that it is not
        # taken for one of the CLI's requests (seen on a busy machine).
        assert wait_until(lambda: refused.headers["x-request-id"] in server.log(), 60)
        claude = ClaudeCode(home, server, key)
        _, claude_first = claude.turn("Reply with one word: hello.")
        _, claude_second = claude.turn("Now reply with one word: goodbye.", resume=True)
        assert_reuses(claude_first, claude_second)  # the slot still holds it

        codex = Codex(home, server, key)
        _, codex_first = codex.turn("Reply with one word: hello.")
        # Two unrelated requests take both slots: the agent's prefix goes to the host tier, and
        # its next turn is restored into the slot that did not compute it.
        for filler in ("Name a colour.", "Name a fruit."):
            response = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": DEFAULT_MODEL, "max_tokens": 1,
                                        "messages": [{"role": "user", "content": filler}]}, timeout=120)
            assert response.status_code == 200, response.text
        host_hits = server.health(key)["models"][DEFAULT_MODEL]["stats"]["host_hits"]
        _, codex_second = codex.turn("Now reply with one word: goodbye.", resume=True)
        assert_reuses(codex_first, codex_second)
        assert server.health(key)["models"][DEFAULT_MODEL]["stats"]["host_hits"] > host_hits

    # A restart on the same disk cache: both agents' next turns start from what was saved.
    with run_server(*server_args(home), log_dir=home, env=env) as server:
        claude.server = server
        codex.point_at(server)
        _, claude_third = claude.turn("Reply with one word: thanks.", resume=True)
        assert_reuses(claude_second, claude_third)
        _, codex_third = codex.turn("Reply with one word: thanks.", resume=True)
        assert_reuses(codex_second, codex_third)


@pytest.mark.timeout(CLI_TIMEOUT_S)
def test_codex_in_open_mode(tmp_path):
    with run_server(*server_args(tmp_path), log_dir=tmp_path) as server:
        codex = Codex(tmp_path, server, "any-key-in-open-mode")
        events, served = codex.turn("Reply with one word: hello.")
        usage = [e["usage"] for e in events if e["type"] == "turn.completed"][0]
        prompts = [r["prompt_tokens"] for r in served.generations()]
        assert usage["input_tokens"] in (sum(prompts), prompts[-1]), (usage, prompts)  # what the server counted
