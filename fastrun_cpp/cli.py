"""The `fastrun-cpp` command."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from pydantic import ValidationError

from fastrun_cpp import __version__
from fastrun_cpp.default_model import ModelNotFoundError, resolve_model
from fastrun_cpp.settings import Settings

logger = logging.getLogger("fastrun_cpp")


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (`--ctx-size` for FASTRUN_CTX_SIZE); given flags override env vars."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} [env FASTRUN_{name.upper()}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(),
                                help=help_text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrun-cpp", description="OpenAI-compatible server on llama.cpp")
    parser.add_argument("--version", action="version", version=f"fastrun-cpp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the fastrun API")
    _add_settings_flags(serve)
    return parser


def serve(overrides: dict[str, Any]) -> int:
    import uvicorn

    from fastrun_cpp.entrypoints.openai.api_server import build_app
    from fastrun_cpp.logging_config import configure_logging

    settings = Settings(**overrides)
    configure_logging(settings.log_level)
    try:
        resolve_model(settings.model)
    except ModelNotFoundError as exc:
        logger.error("%s", exc)
        return 2
    uvicorn.run(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the logging configured above
        timeout_graceful_shutdown=30,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    try:
        if command == "serve":
            return serve(args)
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            print(f"fastrun-cpp: invalid setting {field}: {error['msg']}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
