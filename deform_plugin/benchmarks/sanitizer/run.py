"""Run the targets (:mod:`.targets`) under compute-sanitizer's tools and write one table of what each reported.

For each case the runner first runs the target natively, with every ``torch.empty`` poisoned with NaN
(``--poison``): that fills Triton's on-disk cache (a compile inside the sanitizer is many times slower) and gives
each case's checks without a sanitizer. Then it runs ``compute-sanitizer --tool TOOL --error-exitcode 86
python -m deform_plugin.benchmarks.sanitizer.targets CASE`` per tool and case, in parallel processes, each within a
timeout, reads the error summary and each reported error with its kernel (:mod:`.reports`), keeps the raw log and
rewrites ``sanitize.md`` and ``sanitize.json`` after every run (a run cut short leaves the table so far; SIGTERM,
as ``timeout`` sends, ends the running targets and writes the table).

Memory checks and PyTorch's caching allocator: the allocator hands out pieces of large blocks it keeps, so an
access past a tensor's end that stays inside the block, or a read of memory an earlier tensor wrote, is invisible to
memcheck and initcheck. The kernel cases therefore run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` under memcheck and
initcheck (every tensor its own ``cudaMalloc``; memcheck also pads each allocation, ``--padding``). CUDA graphs need
the caching allocator (a capture allocates from its private pool), so the graph cases keep it: there memcheck and
initcheck see only accesses outside the pool's blocks and reads of never-written pool memory. The table says which
runs had the allocator on. racecheck watches shared memory and is unaffected.

Nothing is filtered: API errors (``Program hit ... on CUDA API call to ...``), PyTorch's and cuBLAS's kernels'
reports and leaks are listed with the rest, by category. Exit status: 0 when every run is clean and every check
passed, 1 otherwise, 2 when compute-sanitizer or a CUDA device is missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .reports import grouped_findings, parse_sanitizer_output

TARGET_MODULE = "deform_plugin.benchmarks.sanitizer.targets"
TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
DEFAULT_TOOLS = ("memcheck", "initcheck", "racecheck")
ERROR_EXITCODE = 86
# Bytes of guard memory memcheck puts after each allocation, so that an overrun lands outside every allocation.
MEMCHECK_PADDING = 512
NO_CACHING_ENV = "PYTORCH_NO_CUDA_MEMORY_CACHING"


def sanitizer_candidates() -> List[str]:
    """Where compute-sanitizer may be: PATH, $CUDA_HOME/$CUDA_PATH, /usr/local/cuda*, and the NVIDIA pip wheels
    (``nvidia-cuda-sanitizer-api*``) of this Python."""
    candidates = [shutil.which("compute-sanitizer")]
    for variable in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(variable):
            candidates.append(os.path.join(os.environ[variable], "bin", "compute-sanitizer"))
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    candidates += sorted(glob.glob("/opt/nvidia/*/bin/compute-sanitizer"), reverse=True)
    candidates += _wheel_candidates()
    return [c for c in candidates if c]


def _wheel_candidates() -> List[str]:
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return []
    found = []
    for root in getattr(nvidia, "__path__", []):
        base_depth = root.rstrip(os.sep).count(os.sep)
        for directory, subdirectories, files in os.walk(root):
            if directory.count(os.sep) - base_depth >= 4:
                subdirectories[:] = []
            if "compute-sanitizer" in files:
                found.append(os.path.join(directory, "compute-sanitizer"))
    return sorted(found)


def find_sanitizer(explicit: Optional[str] = None) -> Optional[str]:
    """The compute-sanitizer executable (``explicit`` if given), or None."""
    for candidate in ([explicit] if explicit else sanitizer_candidates()):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class Run:
    """One target process: a case natively (``tool`` None) or under one sanitizer tool. ``case`` may name several
    cases of one kind, comma-separated (``--group-dtypes``): one process runs them one after another."""

    case: str
    tool: Optional[str]
    status: str = "not run"
    seconds: float = 0.0
    exit_code: Optional[int] = None
    caching_allocator: bool = True
    error_summary: Optional[int] = None
    race_summary: Optional[str] = None
    findings: List[dict] = field(default_factory=list)
    checks_passed: Optional[int] = None
    checks_total: Optional[int] = None
    failed_checks: List[str] = field(default_factory=list)
    log: Optional[str] = None

    @property
    def name(self) -> str:
        from .targets import parse_case
        cases = self.case.split(",")
        label = cases[0] if len(cases) == 1 else parse_case(cases[0])[0] + "_" + "-".join(
            parse_case(case)[1] for case in cases)
        return f"{self.tool or 'native'}_{label.replace(':', '_')}"

    @property
    def ok(self) -> bool:
        return self.status == "clean"


def uses_caching_allocator(case: str, tool: Optional[str]) -> bool:
    from .targets import is_graph_case
    return tool not in ("memcheck", "initcheck") or any(is_graph_case(each) for each in case.split(","))


def group_by_kind(cases: Sequence[str]) -> List[str]:
    """The cases of each kind joined into one comma-separated entry, kinds in their first order."""
    from .targets import parse_case
    groups: Dict[str, List[str]] = {}
    for case in cases:
        groups.setdefault(parse_case(case)[0], []).append(case)
    return [",".join(group) for group in groups.values()]


def target_command(case: str, device: str, json_path: Path, poison: bool, tiny: bool) -> List[str]:
    command = [sys.executable, "-m", TARGET_MODULE, *case.split(","), "--device", device, "--json", str(json_path)]
    return command + (["--poison"] if poison else []) + (["--tiny"] if tiny else [])


def sanitizer_command(sanitizer: str, tool: str, target: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    """``compute-sanitizer --tool TOOL ...`` around ``target``: a distinct exit code for reported errors, every
    error printed up to 10000, memcheck's guard padding."""
    command = [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE), "--print-limit", "10000"]
    if tool == "memcheck":
        command += ["--padding", str(MEMCHECK_PADDING)]
    return command + list(extra) + list(target)


def run_environment(case: str, tool: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(NO_CACHING_ENV, None)
    if not uses_caching_allocator(case, tool):
        env[NO_CACHING_ENV] = "1"
    return env


# The processes running now (each in a session of its own), so that SIGTERM to the runner ends them too.
_running: set = set()
_running_lock = threading.Lock()
_stopping = threading.Event()


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_running_processes(signum=None, frame=None) -> None:
    """End every running target process (a SIGTERM handler: ``timeout`` or a job's end stops the runner) and
    start no more."""
    _stopping.set()
    with _running_lock:
        for process in list(_running):
            _kill_group(process)


def _run_process(command: List[str], env: Dict[str, str], log_path: Path, timeout: float):
    """``(exit code or None on timeout, output)``; the whole process group is killed at the timeout."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        with _running_lock:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            _running.add(process)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.wait()
            code = None
        finally:
            with _running_lock:
                _running.discard(process)
    return code, log_path.read_text(errors="replace")


def _read_checks(run: Run, json_path: Path) -> None:
    try:
        cases = json.loads(json_path.read_text())["cases"]
    except (OSError, ValueError, KeyError):
        return
    checks = [check for case in cases.values() for check in case["checks"]]
    run.checks_total = len(checks)
    run.checks_passed = sum(check["passed"] for check in checks)
    run.failed_checks = [f"{check['name']} ({check['error']:.3g} > {check['limit']:.3g})"
                         for check in checks if not check["passed"]]


def execute(run: Run, out_dir: Path, sanitizer: Optional[str], device: str, timeout: float, tiny: bool,
            extra: Sequence[str] = ()) -> Run:
    logs = out_dir / "logs"
    json_path = logs / f"{run.name}.checks.json"
    json_path.unlink(missing_ok=True)
    # Natively the allocations are poisoned (unwritten elements show as NaN); under a tool they stay as allocated.
    target = target_command(run.case, device, json_path, poison=run.tool is None, tiny=tiny)
    command = target if run.tool is None else sanitizer_command(sanitizer, run.tool, target, extra)
    run.caching_allocator = uses_caching_allocator(run.case, run.tool)
    log_path = logs / f"{run.name}.log"
    run.log = str(log_path.relative_to(out_dir))
    started = time.perf_counter()
    code, output = _run_process(command, run_environment(run.case, run.tool), log_path, timeout)
    run.seconds = time.perf_counter() - started
    run.exit_code = code
    _read_checks(run, json_path)
    if run.tool is not None:
        report = parse_sanitizer_output(output)
        run.error_summary, run.race_summary = report.error_summary, report.race_summary
        run.findings = grouped_findings(report.findings)
    if _stopping.is_set() and (code is None or code < 0):
        run.status = "stopped (the runner was terminated)"
    elif code is None:
        run.status = f"timeout ({timeout:.0f} s)"
    elif run.findings or (run.error_summary or 0) > 0:
        reported = max(sum(finding["count"] for finding in run.findings), run.error_summary or 0)
        run.status = f"{reported} reported"
    elif run.tool is not None and run.error_summary is None:
        run.status = f"no error summary (exit {code})"
    elif run.checks_total is not None and run.checks_passed != run.checks_total:
        run.status = f"checks failed ({run.checks_total - run.checks_passed})"
    elif code != 0:
        run.status = f"exit {code}"
    else:
        run.status = "clean"
    return run


def _findings_cell(run: Run) -> str:
    if not run.findings:
        return ""
    return "; ".join(f"{f['category']} in {f['kernel']}: {f['message']} (x{f['count']})" for f in run.findings)


def write_report(runs: Sequence[Run], out_dir: Path, header_lines: Sequence[str]) -> str:
    from deform_plugin.benchmarks.common import markdown_table

    header = ["tool", "case", "status", "ERROR SUMMARY", "findings (category in kernel: message x count)",
              "checks passed", "caching allocator", "s", "log"]
    rows = []
    for run in runs:
        checks = "-" if run.checks_total is None else f"{run.checks_passed}/{run.checks_total}"
        if run.failed_checks:
            checks += " (failed: " + "; ".join(run.failed_checks[:5]) + ")"
        rows.append([run.tool or "native (NaN-poisoned)", run.case, run.status,
                     "-" if run.error_summary is None else run.error_summary,
                     _findings_cell(run).replace("|", "\\|"), checks,
                     "on" if run.caching_allocator else "off", f"{run.seconds:.0f}", run.log or "-"])
    text = "\n".join(header_lines) + "\n\n" + markdown_table(header, rows) + "\n"
    (out_dir / "sanitize.md").write_text(text)
    (out_dir / "sanitize.json").write_text(json.dumps(dict(header=list(header_lines),
                                                           runs=[vars(run) for run in runs]), indent=1))
    return text


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    from .targets import all_cases
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for sanitize.md, sanitize.json and logs/")
    parser.add_argument("--tools", nargs="+", default=list(DEFAULT_TOOLS), choices=TOOLS,
                        help=f"sanitizer tools (default: {' '.join(DEFAULT_TOOLS)})")
    parser.add_argument("--cases", nargs="+", default=["all"],
                        help=f"target cases KIND:DTYPE (default: all: {' '.join(all_cases())})")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="processes at once (default: half the CPUs, at most 8)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process (default: 300)")
    parser.add_argument("--deadline", type=float,
                        help="seconds from the start after which no new process starts (the rest: 'not run')")
    parser.add_argument("--sanitizer", help="compute-sanitizer executable (default: searched, see --list-paths)")
    parser.add_argument("--sanitizer-args", default="", help="extra compute-sanitizer arguments, one string")
    parser.add_argument("--skip-native", action="store_true",
                        help="no native runs first (Triton's cache must be warm already)")
    parser.add_argument("--native", action="store_true",
                        help="only the native (NaN-poisoned) runs, no sanitizer: checks the targets anywhere")
    parser.add_argument("--device", default="cuda", help="the targets' device (cpu with --native and "
                        "TRITON_INTERPRET=1 runs the kernel cases in Triton's interpreter)")
    parser.add_argument("--tiny", action="store_true", help="kernel cases at their smallest shape only")
    parser.add_argument("--group-dtypes", action="store_true",
                        help="one process per kind and tool, running its dtypes one after another (fewer process "
                             "and CUDA starts under the sanitizer; a report then names the kernel, and the log's "
                             "order the dtype)")
    return parser


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    from .targets import expand_cases
    try:
        cases = expand_cases(args.cases)
    except ValueError as error:
        parser.error(str(error))
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    import torch

    sanitizer = None
    if not args.native:
        if not torch.cuda.is_available():
            print("sanitize_kernels: needs a CUDA GPU (none visible); --native runs the targets without one",
                  file=sys.stderr)
            return 2
        sanitizer = find_sanitizer(args.sanitizer)
        if sanitizer is None:
            looked = [args.sanitizer] if args.sanitizer else sanitizer_candidates() + [
                "PATH", "$CUDA_HOME/bin", "/usr/local/cuda*/bin", "the nvidia pip wheels"]
            print(f"sanitize_kernels: compute-sanitizer not found (looked in: {', '.join(dict.fromkeys(looked))}); "
                  "pass --sanitizer PATH", file=sys.stderr)
            return 2
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    from deform_plugin.benchmarks.common import machine_info, machine_line
    header_lines = [machine_line(machine_info(torch.device(args.device))),
                    f"compute-sanitizer: {sanitizer or 'not used (--native)'}"
                    + (f" ({sanitizer_version(sanitizer)})" if sanitizer else "")]
    started = time.perf_counter()
    lock = threading.Lock()
    native = [] if args.skip_native else [Run(case, None) for case in cases]
    # Tool by tool in the order given (a deadline then cuts the last tools), slowest cases first.
    from .targets import is_graph_case
    if args.group_dtypes:  # the native runs stay one per case: more processes compile Triton's kernels at once
        cases = group_by_kind(cases)
    ordered = sorted(cases, key=lambda case: not is_graph_case(case.split(",")[0]))
    sanitized = [] if args.native else [Run(case, tool) for tool in args.tools for case in ordered]
    runs = native + sanitized
    extra = args.sanitizer_args.split()

    def one(run: Run) -> Run:
        if _stopping.is_set():
            run.status = "not run (the runner was terminated)"
        elif args.deadline is not None and time.perf_counter() - started > args.deadline:
            run.status = "not run (deadline)"
        else:
            execute(run, out_dir, sanitizer, args.device, args.timeout, args.tiny, extra)
        with lock:
            write_report(runs, out_dir, header_lines)
            print(f"{run.tool or 'native'} {run.case}: {run.status} ({run.seconds:.0f} s)"
                  + (f" {_findings_cell(run)}" if run.findings else ""), flush=True)
        return run

    _stopping.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()  # where a handler can be set
    previous_handler = signal.signal(signal.SIGTERM, stop_running_processes) if in_main_thread else None
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, native))  # the Triton cache is warm before any sanitized run starts
            list(pool.map(one, sanitized))
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    text = write_report(runs, out_dir, header_lines)
    print(text)
    return 0 if all(run.ok for run in runs) else 1


def sanitizer_version(sanitizer: str) -> str:
    try:
        output = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"version unknown: {error}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "version unknown"


if __name__ == "__main__":
    sys.exit(main())
