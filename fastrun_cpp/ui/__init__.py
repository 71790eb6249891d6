"""The web page: its own files (index.html, app.js, app.css) and the libraries it uses, copied
from their npm packages (vendor.json, scripts/vendor_ui.py). No build step: the files are
served as they are, by fastrun_cpp/entrypoints/ui.py."""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
