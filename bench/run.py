"""Run every benchmark in bench/ (``make bench``).

Each ``bench/bench_<area>.py`` has a ``main()`` that times competing
implementations side by side in this one process and prints ratios;
absolute times on a shared machine are noise, ratios are the result.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import numpy as np

    print(f"# kimilab benchmarks  python {platform.python_version()}  numpy {np.__version__}  "
          f"cores {os.cpu_count()}")
    failed = []
    for path in sorted(HERE.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(f"\n## {path.stem}", flush=True)
        start = time.perf_counter()
        try:
            module.main()
        except Exception as exc:  # report and go on: one broken bench must not hide the others
            print(f"FAILED: {type(exc).__name__}: {exc}")
            failed.append(path.stem)
        print(f"({time.perf_counter() - start:.1f} s)", flush=True)
    if failed:
        print(f"\nfailed benchmarks: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
