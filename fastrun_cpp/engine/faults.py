"""Fault injection, so tests can drive the failure paths of a real server.

`--debug-faults "load-delay=3,decode-fail=2,decode-fail=7"`: delay model loading by 3 s, and
make the 2nd and 7th `llama_decode` calls fail as a broken backend would. `decode-fail=1@0`
targets replica 0 of a pool only. `schema-hang` makes the conversion of any schema titled
"fastrun-debug-hang" hang, and `grammar-hang` the trial compile of any grammar holding
GRAMMAR_HANG_TEXT (to test their time limits). `replica-exit=SEED`: with --backend ray,
the replica that gets a request with that sampling seed dies before answering (once);
`replica-exit-queued=SEED`: after accepting it, before its first token (once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


GRAMMAR_HANG_TEXT = "fastrun-debug-grammar-hang"


@dataclass
class Faults:
    load_delay_s: float = 0.0
    decode_failures: frozenset[int] = frozenset()  # 1-based numbers of the decode calls that fail
    schema_hang: bool = False  # schema conversions of a schema titled "fastrun-debug-hang" hang
    grammar_hang: bool = False  # a trial compile of a grammar holding GRAMMAR_HANG_TEXT burns a core until killed
    _decodes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def parse(cls, spec: str, *, replica: int = 0) -> Faults:
        faults = cls()
        failures = set()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = item.partition("=")
            value, _, target = value.partition("@")
            if target and int(target) != replica:
                continue
            if name == "load-delay":
                faults.load_delay_s = float(value)
            elif name == "decode-fail":
                failures.add(int(value))
            elif name == "schema-hang":
                faults.schema_hang = True
            elif name == "grammar-hang":
                faults.grammar_hang = True
            elif name in ("replica-exit", "replica-exit-queued"):
                pass  # Ray replicas read it themselves (runtime.ray_backend)
            else:
                raise ValueError(f"unknown fault {name!r} (known: load-delay, decode-fail, schema-hang, grammar-hang, "
                                 "replica-exit, replica-exit-queued)")
        faults.decode_failures = frozenset(failures)
        return faults

    def decode_fails(self) -> bool:
        """Count a decode call; True when this one is to fail."""
        if not self.decode_failures:
            return False
        with self._lock:
            self._decodes += 1
            return self._decodes in self.decode_failures
