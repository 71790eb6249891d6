"""Logging for the server process: one format for our logs, uvicorn's and llama.cpp's."""

from __future__ import annotations

import logging.config


def configure_logging(level: str) -> None:
    level = level.upper()
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {
                "plain": {"format": "%(asctime)s %(levelname)-7s %(name)s: %(message)s"},
            },
            "handlers": {
                "stderr": {"class": "logging.StreamHandler", "formatter": "plain"},
            },
            "loggers": {
                "fastrun_cpp": {"level": level},
                # llama.cpp's chatter is only worth seeing when debugging.
                "fastrun_cpp.llama": {"level": "DEBUG" if level == "DEBUG" else "WARNING"},
                "uvicorn": {"level": level},
                "uvicorn.access": {"level": level},
            },
            "root": {"handlers": ["stderr"], "level": "WARNING"},
        }
    )
