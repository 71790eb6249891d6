"""The `fastrun-cpp` command: `serve`, and `keys` to manage API keys."""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import signal
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pydantic import ValidationError

from fastrun_cpp import __version__, cpu
from fastrun_cpp.default_model import ModelNotFoundError
from fastrun_cpp.limits import Limits
from fastrun_cpp.registry import registry_from_settings
from fastrun_cpp.settings import Settings

logger = logging.getLogger("fastrun_cpp")

LIMIT_PREFIX = "limit__"


@dataclass(frozen=True)
class SettingFlag:
    """One setting as `serve` takes it: a flag, and the environment variable it overrides."""

    flag: str
    dest: str
    env: str
    kind: Literal["switch", "list", "value"]
    description: str
    default: Any  # None: unset (the model's own default, or nothing), as the description says


def settings_flags(names: Sequence[str] | None = None) -> list[SettingFlag]:
    """One flag per setting (`--ctx-size` for FASTRUN_CTX_SIZE, `--limit-messages` for
    FASTRUN_LIMITS__MESSAGES): what argparse is given, and what docs/flags.md lists."""
    flags = []
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        if name == "limits":
            flags += [SettingFlag(f"--limit-{limit.replace('_', '-')}", f"{LIMIT_PREFIX}{limit}",
                                  f"FASTRUN_LIMITS__{limit.upper()}", "value", limit_field.description,
                                  limit_field.default)
                      for limit, limit_field in Limits.model_fields.items()]
            continue
        listed = [field.annotation, *typing.get_args(field.annotation)]  # list[...] or list[...] | None
        kind = ("switch" if field.annotation in (bool, bool | None)
                else "list" if any(typing.get_origin(each) is list for each in listed) else "value")
        # A default computed on this machine is shown as the settings describe it.
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        default = extra.get("shown_default", field.get_default(call_default_factory=True))
        flags.append(SettingFlag("--" + name.replace("_", "-"), name, f"FASTRUN_{name.upper()}", kind,
                                 field.description or "", default))
    return flags


def _add_settings_flags(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """The settings' flags; given flags override env vars."""
    for setting in settings_flags(names):
        default = f" [default: {setting.default}]" if setting.dest.startswith(LIMIT_PREFIX) else ""
        help_text = f"{setting.description}{default} [env {setting.env}]".replace("%", "%%")
        if setting.kind == "switch":
            parser.add_argument(setting.flag, dest=setting.dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif setting.kind == "list":
            # Repeatable, and each may take several: --lora a=x.gguf --lora b=y.gguf
            parser.add_argument(setting.flag, dest=setting.dest, nargs="*", action="extend", default=argparse.SUPPRESS,
                                metavar=setting.dest.upper(), help=help_text)
        else:
            parser.add_argument(setting.flag, dest=setting.dest, default=argparse.SUPPRESS,
                                metavar="N" if setting.dest.startswith(LIMIT_PREFIX) else setting.dest.upper(),
                                help=help_text)


def flags_markdown() -> str:
    """docs/flags.md: every `serve` flag, from the settings' own descriptions
    (`fastrun-cpp flags > docs/flags.md`; tests/test_cli.py fails when it is stale)."""
    lines = ["# `fastrun-cpp serve` flags", "",
             "Every flag, the environment variable it overrides, and its default. Generated from the "
             "settings' own descriptions (`fastrun_cpp/settings.py`, `fastrun_cpp/limits.py`) by "
             "`fastrun-cpp flags > docs/flags.md`; a test fails when this page is stale.", "",
             "| flag | environment | default | what it does |", "|---|---|---|---|"]
    for setting in settings_flags():
        description, default = setting.description, setting.default
        if (marker := description.rfind(" [default: ")) >= 0 and description.endswith("]"):
            description, default = description[:marker], description[marker + len(" [default: "):-1]
        flag = f"`{setting.flag}` / `--no-{setting.flag[2:]}`" if setting.kind == "switch" else f"`{setting.flag}`"
        shown = "" if default is None or default == "" else f"`{default}`"
        lines.append(f"| {flag} | `{setting.env}` | {shown} | {description.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrun-cpp", description="OpenAI-compatible server on llama.cpp")
    parser.add_argument("--version", action="version", version=f"fastrun-cpp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the fastrun API")
    _add_settings_flags(serve)
    # llama-server's own spelling, for users who bring its command line.
    serve.add_argument("--no-mmproj", dest="mmproj_auto", action="store_false", default=argparse.SUPPRESS,
                       help="the same as --no-mmproj-auto (llama-server's name)")

    commands.add_parser("flags", help="the serve flags as a Markdown table (docs/flags.md)")

    pull = commands.add_parser("pull", help="download a GGUF from the Hugging Face Hub into the HF cache")
    pull.add_argument("repo", help="owner/name")
    pull.add_argument("file", nargs="?", help="the .gguf to fetch (default: the repository's only one)")
    pull.add_argument("--revision", help="branch, tag or commit")

    keys = commands.add_parser("keys", help="manage API keys (stored hashed in --keys-db)")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="mint a key; it is printed once, as the last line")
    create.add_argument("--account", required=True)
    create.add_argument("--pending", action="store_true",
                        help="create a new account unapproved (its keys are refused until `keys approve`)")
    listing = key_commands.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--account")
    revoke = key_commands.add_parser("revoke", help="revoke a key by its id (see `keys list`)")
    revoke.add_argument("key_id", type=int)
    approve = key_commands.add_parser("approve", help="let an account's keys in")
    approve.add_argument("account")
    unapprove = key_commands.add_parser("unapprove", help="refuse an account's keys")
    unapprove.add_argument("account")
    admin = key_commands.add_parser("admin", help="let an account's keys read /metrics (it shows every account's use) "
                                      "and load, unload and pull models")
    admin.add_argument("account")
    admin.add_argument("--off", action="store_true", help="take the right away again")
    share = key_commands.add_parser(
        "share-cache", help="let accounts that trust each other reuse each other's cached prompts (one group each)")
    share.add_argument("account")
    share.add_argument("group", nargs="?", help="the group's name; omitted: the account's prompts are its own again")
    weight = key_commands.add_parser(
        "weight", help="an account's share of the slots against other accounts with work waiting (default 1)")
    weight.add_argument("account")
    weight.add_argument("weight", type=float)
    priority = key_commands.add_parser(
        "priority", help="the most urgent request priority an account may ask for (lower runs first; default 0)")
    priority.add_argument("account")
    priority.add_argument("priority", type=int)
    limit = key_commands.add_parser(
        "limit", help="an account's limits, answered with 429 and Retry-After (0 removes one)")
    limit.add_argument("account")
    limit.add_argument("--rpm", type=int, help="requests per minute")
    limit.add_argument("--tpm", type=int, help="prompt and completion tokens per minute")
    limit.add_argument("--concurrent", type=int, help="requests in flight at once")
    usage = key_commands.add_parser("usage", help="requests and tokens used per account (kept across restarts)")
    usage.add_argument("--account")
    usage.add_argument("--since", type=_since, help="from this date or time on (ISO 8601, e.g. 2026-11-01)")
    for sub in (create, listing, revoke, approve, unapprove, admin, share, weight, priority, limit, usage):
        _add_settings_flags(sub, names=("keys_db",))
    return parser


def _nest_limits(overrides: dict[str, Any]) -> dict[str, Any]:
    """`--limit-x` flags into the `limits` setting (over FASTRUN_LIMITS__* variables)."""
    given = {k.removeprefix(LIMIT_PREFIX): v for k, v in overrides.items() if k.startswith(LIMIT_PREFIX)}
    rest = {k: v for k, v in overrides.items() if not k.startswith(LIMIT_PREFIX)}
    if given:
        rest["limits"] = {**Settings().limits.model_dump(), **given}
    return rest


def serve(overrides: dict[str, Any]) -> int:
    settings = Settings(**_nest_limits(overrides))
    # Whether llama.cpp runs on this CPU is seen in a child process, while this one imports.
    build_probe = cpu.BuildProbe()
    # Importing the server and building its app make ~200k objects, all kept for its life: the
    # collector, off meanwhile, would only trace them again and again (a quarter of the start).
    gc.disable()
    import uvicorn

    from fastrun_cpp.entrypoints.auth import is_loopback
    from fastrun_cpp.entrypoints.http_protocol import with_header_timeout
    from fastrun_cpp.entrypoints.openai.api_server import authenticator_for, build_app
    from fastrun_cpp.entrypoints.openai.responses.sealed import SealSecretError
    from fastrun_cpp.logging_config import configure_logging

    configure_logging(settings.log_level)
    if not cpu_supports_build(build_probe.result()):
        return 2
    try:
        registry = registry_from_settings(settings)
        if settings.backend != "ray":
            from fastrun_cpp.runtime.model_runtime import check_kernel_modes

            check_kernel_modes(registry.models)
    except (ModelNotFoundError, ValueError, OSError) as exc:  # bad --model or models file
        logger.error("%s", exc)
        return 2
    authenticator = authenticator_for(settings)
    authenticator.load()
    if settings.auth and not is_loopback(settings.host) and authenticator.store_is_empty:
        logger.error(
            "refusing to serve on %s without API keys: create one with `fastrun-cpp keys create "
            "--account NAME` (key store %s), or pass --no-auth to serve openly on purpose",
            settings.host, settings.keys_db,
        )
        return 2
    # uvicorn drains on SIGTERM, then re-raises the signal to whatever handler was there
    # before; a handler of ours makes that a clean exit (status 0) instead of death by signal.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("shut down after SIGTERM"))
    try:
        app = build_app(settings, authenticator)
    except SealSecretError as exc:
        logger.error("%s", exc)
        return 2
    # What startup made stays: frozen, the collector skips it from now on (and at exit).
    gc.freeze()
    gc.enable()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        http=with_header_timeout(settings.limits.header_timeout_s),
        log_config=None,  # keep the logging configured above
        access_log=False,  # fastrun_cpp.access writes one JSON line per request instead
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    return 0


def cpu_supports_build(check: cpu.BuildCheck) -> bool:
    """Refuse to start, with one line saying what to do, when the llama.cpp build uses
    instructions this CPU lacks (it would die of SIGILL); otherwise log what it uses."""
    if check.wrong_cpu:
        problem = check.crashed or f"it uses {', '.join(check.missing)}, which this CPU lacks"
        logger.error("llama.cpp was built for another CPU (%s): run `make setup` again to build it for "
                     "this one", problem)
        return False
    if not check.ok:
        logger.error("llama.cpp cannot be loaded here: %s", check.crashed)
        return False
    logger.info("llama.cpp CPU build: %s (this CPU: %s %s)", " ".join(check.features) or "baseline",
                cpu.machine(), cpu.cpu_name())
    return True


def pull(repo: str, filename: str | None, revision: str | None) -> int:
    from fastrun_cpp.hub import HubError, pull as pull_model

    try:
        path = pull_model(repo, filename, revision=revision)
    except HubError as exc:
        print(f"fastrun-cpp: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def keys(command: str, args: dict[str, Any]) -> int:
    from fastrun_cpp.auth import KeyStore, KeyStoreError

    store = KeyStore(Settings(**{k: v for k, v in args.items() if k == "keys_db"}).keys_db)
    try:
        if command == "create":
            info, key = store.create_key(args["account"], approve_new_account=not args["pending"])
            state = "approved" if info.account_approved else "NOT approved yet (run `keys approve`)"
            print(f"key {info.id} for account {info.account!r} ({state}); store {store.path}")
            print("this is the only time the key is shown:")
            print(key)
        elif command == "list":
            rows = store.list_keys(args.get("account"))
            print(f"{'id':>4}  {'account':20}  {'key':10}  {'state':10}  account")
            for info in rows:
                state = "revoked" if info.revoked_at else "active"
                account = "approved" if info.account_approved else "not approved"
                print(f"{info.id:>4}  {info.account:20}  {info.display_prefix + '…':10}  {state:10}  {account}")
        elif command == "revoke":
            if not store.revoke(args["key_id"]):
                print(f"no active key with id {args['key_id']}", file=sys.stderr)
                return 1
            print(f"revoked key {args['key_id']}")
        elif command in ("approve", "unapprove"):
            if not store.set_approved(args["account"], command == "approve"):
                print(f"no account {args['account']!r}", file=sys.stderr)
                return 1
            print(f"account {args['account']!r} {command}d")
        elif command == "admin":
            if not store.set_admin(args["account"], not args["off"]):
                print(f"no account {args['account']!r}", file=sys.stderr)
                return 1
            print(f"account {args['account']!r} {'may not' if args['off'] else 'may'} read /metrics")
        elif command == "share-cache":
            if not store.set_cache_group(args["account"], args["group"]):
                print(f"no account {args['account']!r}", file=sys.stderr)
                return 1
            group = args["group"]
            print(f"account {args['account']!r} shares cached prompts with group {group!r}" if group
                  else f"account {args['account']!r} keeps its cached prompts to itself")
        elif command in ("weight", "priority", "limit"):
            if command == "weight":
                found = store.set_weight(args["account"], args["weight"])
                done = f"account {args['account']!r} has weight {args['weight']:g}"
            elif command == "priority":
                found = store.set_min_priority(args["account"], args["priority"])
                done = f"account {args['account']!r} may ask for priority {args['priority']} or less urgent"
            else:
                found = store.set_limits(args["account"], rpm=args["rpm"], tpm=args["tpm"],
                                         max_concurrent=args["concurrent"])
                done = f"account {args['account']!r}: limits set"
            if not found:
                print(f"no account {args['account']!r}", file=sys.stderr)
                return 1
            print(done)
        elif command == "usage":
            rows = store.usage(args.get("account"), args.get("since"))
            print(f"{'account':20}  {'requests':>9}  {'prompt':>11}  {'cached':>11}  {'completion':>11}  "
                  f"{'batch requests':>14}  {'batch prompt':>12}  {'batch completion':>16}")
            for account, used in rows.items():
                print(f"{account:20}  {used.requests:>9}  {used.prompt_tokens:>11}  {used.cached_tokens:>11}  "
                      f"{used.completion_tokens:>11}  {used.batch_requests:>14}  {used.batch_prompt_tokens:>12}  "
                      f"{used.batch_completion_tokens:>16}")
    except KeyStoreError as exc:
        print(f"fastrun-cpp: {exc}", file=sys.stderr)
        return 1
    return 0


def _since(value: str) -> int:
    """An ISO 8601 date or time (UTC unless it says) as Unix time."""
    try:
        # Python 3.10's parser takes no "Z" (3.11's does): the same moment written as +00:00.
        moment = datetime.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date or time: {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp())


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    try:
        if command == "serve":
            return serve(args)
        if command == "keys":
            return keys(args.pop("keys_command"), args)
        if command == "pull":
            return pull(args["repo"], args["file"], args["revision"])
        if command == "flags":
            print(flags_markdown(), end="")
            return 0
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            print(f"fastrun-cpp: invalid setting {field}: {error['msg']}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
