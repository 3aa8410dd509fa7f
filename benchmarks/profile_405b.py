"""Scale check for issue 2: capture Llama 3 405B on the meta device and print wall time and peak RSS.

Target: ≤ 30 s and ≤ 3 GB peak RSS. Run: ``python benchmarks/profile_405b.py [SPEC]`` (default ``llama3-405b``).
"""

from __future__ import annotations

import resource
import sys
import time


def main(spec: str = "llama3-405b") -> int:
    t0 = time.perf_counter()
    from profiler.api import profile_model  # importing torch is part of what a user waits for

    t_import = time.perf_counter() - t0
    lg = profile_model(spec)
    wall = time.perf_counter() - t0
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    g = lg.model
    print(f"{spec}: {g.num_params / 1e9:.1f}B parameters, {len(g.nodes)} nodes, {len(lg.layers)} layers, "
          f"{len(lg.signatures)} distinct")
    print(f"wall time: {wall:.1f} s (imports {t_import:.1f} s); peak RSS: {rss_bytes / 1e9:.2f} GB")
    return 0 if wall <= 30 and rss_bytes <= 3e9 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
