"""Cost of logprobs: streamed chat at concurrency 8 with `logprobs: true, top_logprobs: 20`
versus without, on one fastrun-cpp server, alternating the two workloads.

    python bench/logprobs.py [--rounds 3] [--concurrency 8] [--max-tokens 128]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ab_workloads  # noqa: E402

WORKLOADS = {"plain": None, "logprobs, top_logprobs 20": {"logprobs": True, "top_logprobs": 20}}

if __name__ == "__main__":
    sys.exit(ab_workloads(__doc__, WORKLOADS))
