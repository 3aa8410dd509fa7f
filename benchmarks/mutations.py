"""Mutation check: inject each of a fixed list of representative bugs into a copy of the code (cost-model formulas,
the search, schedules, collectives, the runtime's gradient synchronisation, the check's extrapolation) and run the
tests that should catch it. A mutant is killed when at least one of them fails; the table lists which.

    python benchmarks/mutations.py            # every mutant (minutes on 2 cores)
    python benchmarks/mutations.py --list     # the mutants only
    python benchmarks/mutations.py --only norm  # the mutants whose name contains "norm"

Each mutant runs in its own copy of the repository (the working tree as it is, without .git), so the checkout is
never modified. A mutant whose text is not found fails the run: the list must follow the code.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  #: file, relative to the repository root
    find: str  #: exact text, present once
    replace: str
    tests: tuple[str, ...]  #: pytest node ids or files expected to catch it
    dist: bool = False  #: run the tests marked dist too (gloo runs against one process: minutes)


MUTANTS = (
    Mutant("interleaving ignores v", "costmodel/estimate.py",
           "        return 1.0 / vpp\n", "        return 1.0\n",
           ("tests/test_costmodel.py",)),
    Mutant("ZeRO-1 keeps the whole optimizer state", "costmodel/memory.py",
           "        k /= dp\n", "        k /= 1\n",
           ("tests/test_costmodel.py",)),
    Mutant("1F1B holds one micro-batch fewer (off by one)", "costmodel/memory.py",
           "else pp - rank  # 1F1B: p − r", "else pp - rank - 1  # 1F1B: p − r",
           ("tests/test_costmodel.py", "tests/test_check.py")),
    Mutant("ring all-reduce moves half its bytes", "costmodel/collectives.py",
           "    return ring_time(nbytes, n, 2 * (n - 1) / n, 2 * (n - 1),",
           "    return ring_time(nbytes, n, (n - 1) / n, 2 * (n - 1),",
           ("tests/test_collectives.py", "tests/test_check.py")),
    Mutant("ZeRO-1 broadcast dropped from the per-step bytes", "costmodel/overlap.py",
           '        out["broadcast"] = params * pbytes\n', '        out["broadcast"] = 0.0 * params * pbytes\n',
           ("tests/test_check.py",)),
    Mutant("sequence-parallel head all-gather not costed", "costmodel/layercost.py",
           "        bf += layer.input_bytes / 2\n", "        bf += 0.0\n",
           ("tests/test_check.py", "tests/test_costmodel.py")),
    Mutant("alternatives blame the term that grew least", "planner/search/outer.py",
           "    key = max(diffs, key=lambda k: (diffs[k], k))", "    key = min(diffs, key=lambda k: (diffs[k], k))",
           ("tests/test_search.py",)),
    Mutant("inspect derives the term that grew least", "planner/report/facts.py",
           "    key = max(diffs, key=lambda k: (diffs[k], k))", "    key = min(diffs, key=lambda k: (diffs[k], k))",
           ("tests/test_inspect.py",)),
    Mutant("search stops at the first candidate", "planner/search/outer.py",
           "            if lb > kth(best_known) or lb >= kth(solved):",
           "            if done > 0 or lb > kth(best_known) or lb >= kth(solved):",
           ("tests/test_search.py",)),
    Mutant("post-step all-reduce skipped (tensor parallel, zero-bubble)", "planner/emit/train.py",
           '    if post_step_allreduce(plan["dp"], plan["tp"], plan["zero"], plan["schedule"], plan["pp"]):',
           '    if False and post_step_allreduce(plan["dp"], plan["tp"], plan["zero"], plan["schedule"], plan["pp"]):',
           ("tests/test_check.py",)),
    Mutant("gradient norm counts every replica", "planner/emit/train.py",
           "total += grad.float().pow(2).sum() * (shards / stage_ranks)", "total += grad.float().pow(2).sum() * shards",
           ("tests/test_emit_dist.py::test_matches_one_process",), dist=True),
    Mutant("gradient norm counts a tied weight on both stages", "planner/emit/train.py",
           "            if id(p) not in tied:\n", "            if True:\n",
           ("tests/test_emit_dist.py::test_matches_one_process",), dist=True),
    Mutant("resume restarts the learning rate", "planner/emit/train.py",
           '            group["lr"] = lr  # the schedule', '            group["lr"] = group["lr"]  # the schedule',
           ("tests/test_emit_dist.py::test_resume_continues_exactly",), dist=True),
    Mutant("MoE dropped pairs contribute", "profiler/zoo/moe.py",
           "out.new_zeros(1, hidden)])  # overflow row = 0", "out.new_full((1, hidden), 7.0)])  # overflow row = 0",
           ("tests/test_zoo.py",)),
    Mutant("gloo_bench --check never fails", "costmodel/gloo_bench.py",
           "        return 0 if graded <= TOLERANCE else 1\n", "        return 0\n",
           ("tests/test_collectives.py",)),
    Mutant("folded check extrapolates from the wrong depth", "planner/check/fold.py",
           "    ts = [folding.runs[stage][k] - FOLD_BLOCKS for stage, k in lengthened]",
           "    ts = [folding.runs[stage][k] - FOLD_BLOCKS - 1 for stage, k in lengthened]",
           ("tests/test_check.py",)),
)


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache")
    shutil.copytree(ROOT, dst, ignore=ignore)


def run(mutant: Mutant, work: Path) -> tuple[list[str], float]:
    """(the tests that failed with the mutant in place, seconds)."""
    where = work / re.sub(r"\W+", "_", mutant.name)
    _copy(where)
    target = where / mutant.path
    text = target.read_text()
    if text.count(mutant.find) != 1:
        raise SystemExit(f"mutant {mutant.name!r}: its text occurs {text.count(mutant.find)} times in "
                         f"{mutant.path}; update benchmarks/mutations.py")
    target.write_text(text.replace(mutant.find, mutant.replace))
    t0 = time.perf_counter()
    # the copy's own code first on the path (the installed package points at the checkout)
    env = {"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin:" + str(Path(sys.executable).parent)}
    marks = [] if mutant.dist else ["-m", "not dist"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, "-rf",
                          *mutant.tests], cwd=where, capture_output=True, text=True, env=env)
    failed = [line.split(" ", 2)[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")]
    if out.returncode not in (0, 1):  # 2-5: the run itself broke (import error, nothing collected)
        failed = failed or [f"(pytest exit {out.returncode}: {out.stdout.strip().splitlines()[-1:]})"]
    return failed, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--only", help="run the mutants whose name contains this text")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if not args.only or args.only in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.path}")
        return 0
    survivors = 0
    print(f"{'mutant':<58s} {'killed by':<70s} {'s':>5s}")
    with tempfile.TemporaryDirectory() as tmp:
        for m in mutants:
            failed, seconds = run(m, Path(tmp))
            survivors += not failed
            killers = ", ".join(sorted({f.split("[")[0] for f in failed})[:3]) + (
                f" (+{len(failed) - 3} more)" if len(failed) > 3 else "")
            print(f"{m.name:<58s} {killers or 'SURVIVED':<70s} {seconds:5.0f}", flush=True)
            shutil.rmtree(Path(tmp) / re.sub(r"\W+", "_", m.name), ignore_errors=True)
    print(f"{len(mutants) - survivors} of {len(mutants)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
