"""Reading compute-sanitizer's text output: its error summary and each reported error with the kernel it names.

compute-sanitizer prefixes its own lines with ``=========`` (the program's output interleaves unprefixed). A record
starts with an unindented line after the prefix (``Invalid __global__ read of size 4 bytes``, ``Uninitialized
__global__ memory read ...``, ``Error: Race reported between Write access at K+0x10 ...``, ``Program hit
cudaErrorInvalidValue (error 1) due to "..." on CUDA API call to cudaMemcpy.``, ``Leaked 64 bytes at 0x...``) and
goes on with indented lines (``    at msda_forward_kernel+0x1b0 in /path/triton_kernels.py:123``, ``    by thread
(0,0,0) in block (0,0,0)``, ``    Address 0x... is out of bounds``, host frames). Two layouts of the "at" line exist:
``at KERNEL+0xOFFSET [in FILE:LINE]`` (CUDA 11.6 and later) and ``at 0xOFFSET in [FILE:LINE:]KERNEL`` (older). The run
ends with ``ERROR SUMMARY: N errors``; racecheck adds ``RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)``,
and from compute-sanitizer 2025.3 prints only that line, whose error count then stands for the summary.

Nothing is filtered: every record becomes a :class:`Finding`, classified (``memory``, ``uninitialized``, ``race``,
``api``, ``leak``, ``other``) so that a table can show what kind of report it is; an API error names its API call in
place of a kernel.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

PREFIX = "========="
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(.*)")
_RACE_ERRORS = re.compile(r"\((\d+)\s+errors?\b")
# "at KERNEL+0x1b0 in FILE:LINE" (KERNEL may hold spaces, templates and arguments: demangled C++ names).
_AT_NEW = re.compile(r"\bat (?P<kernel>.+?)\+0x[0-9a-fA-F]+(?: in (?P<location>\S.*?))?(?: \[\d+ hazards?\])?$")
# "at 0x1b0 in FILE:LINE:KERNEL" or "at 0x1b0 in KERNEL"
_AT_OLD = re.compile(r"\bat 0x[0-9a-fA-F]+ in (?P<rest>.+?)(?: \[\d+ hazards?\])?$")
_API = re.compile(r"Program hit (?P<error>\S+).* on CUDA API call to (?P<call>[A-Za-z0-9_]+)")
# Lines after the prefix that are not the start of an error record.
_NOT_RECORDS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
                "Target application returned an error")


@dataclass
class Finding:
    """One reported error: its first line, the kernel (or API call) it names, where, and its category."""

    message: str
    category: str
    kernel: Optional[str] = None
    location: Optional[str] = None
    lines: List[str] = field(default_factory=list)


@dataclass
class SanitizerReport:
    """What one compute-sanitizer run reported. ``error_summary`` is None where the run printed no summary (it
    crashed, was killed, or its output was cut)."""

    error_summary: Optional[int]
    findings: List[Finding]
    race_summary: Optional[str] = None
    application_failed: bool = False

    @property
    def clean(self) -> bool:
        return self.error_summary == 0 and not self.findings


def _category(message: str) -> str:
    lowered = message.lower()
    if lowered.startswith("program hit") or "api call" in lowered:
        return "api"
    if "uninitialized" in lowered:
        return "uninitialized"
    if "race" in lowered or "hazard" in lowered:
        return "race"
    if lowered.startswith("leaked") or "leak" in lowered:
        return "leak"
    if lowered.startswith(("invalid", "misaligned", "out-of-range", "malloc", "free", "address")):
        return "memory"
    return "other"


def _kernel_from_at_line(text: str):
    match = _AT_OLD.search(text)
    if match:
        rest = match.group("rest")
        # FILE:LINE:KERNEL(args) -> KERNEL(args); a bare kernel name stays as it is.
        located = re.match(r"(?P<file>[^:]+):(?P<line>\d+):(?P<kernel>.+)$", rest)
        if located:
            return located.group("kernel"), f"{located.group('file')}:{located.group('line')}"
        return rest, None
    match = _AT_NEW.search(text)
    if match:
        return match.group("kernel").strip(), match.group("location")
    return None, None


def _names_code(line: str) -> bool:
    # "at K+0x..", "Write access at K+0x..", "Write Thread (31, 0, 0) at 0x148 in f.cu:12:K()"; not "Leaked 64
    # bytes at 0x..", nor racecheck's "hazard detected at __shared__ 0x0 in block (0, 0, 0)".
    return line.startswith("at ") or " access at " in line or bool(re.search(r"Thread \([^)]*\) at ", line))


def _sanitizer_lines(text: str) -> List[str]:
    # The prefix may follow other output on the same line when the program and the sanitizer interleave.
    lines = []
    for raw in text.splitlines():
        index = raw.find(PREFIX)
        if index >= 0:
            lines.append(raw[index + len(PREFIX):])
    return lines


def parse_sanitizer_output(text: str) -> SanitizerReport:
    """Every error record and the summary of one compute-sanitizer run's output (see the module)."""
    summary: Optional[int] = None
    race_summary: Optional[str] = None
    application_failed = False
    findings: List[Finding] = []
    current: Optional[Finding] = None
    for line in _sanitizer_lines(text):
        stripped = line.strip()
        if not stripped:
            current = None
            continue
        match = _SUMMARY.search(stripped)
        if match:
            if summary is None:  # a second summary line only says how many were not printed
                summary = int(match.group(1))
            current = None
            continue
        match = _RACE_SUMMARY.search(stripped)
        if match:
            race_summary = match.group(1).strip()
            current = None
            continue
        if stripped.startswith("Target application returned an error"):
            application_failed = True
            current = None
            continue
        indented = line.startswith(("  ", "\t"))
        if not indented:
            if stripped.startswith(_NOT_RECORDS):
                current = None
                continue
            current = Finding(message=stripped, category=_category(stripped), lines=[stripped])
            api = _API.search(stripped)
            if api:
                current.kernel = f"API {api.group('call')}"
            elif _names_code(stripped):  # racecheck names the first access's kernel on the record's first line
                current.kernel, current.location = _kernel_from_at_line(stripped)
            findings.append(current)
            continue
        if current is None:
            continue
        current.lines.append(stripped)
        if current.kernel is None and _names_code(stripped):
            current.kernel, current.location = _kernel_from_at_line(stripped)
    if summary is None and race_summary is not None:
        errors = _RACE_ERRORS.search(race_summary)
        if errors:
            summary = int(errors.group(1))
    return SanitizerReport(summary, findings, race_summary, application_failed)


def grouped_findings(findings: List[Finding]) -> List[Dict[str, object]]:
    """Findings grouped by category, kernel and message with their count, most frequent first (addresses,
    thread and block numbers differ between repeats of one error, so only the first line is compared)."""
    counts = Counter((f.category, f.kernel or "?", _without_numbers(f.message)) for f in findings)
    return [dict(category=category, kernel=kernel, message=message, count=count)
            for (category, kernel, message), count in counts.most_common()]


def _without_numbers(message: str) -> str:
    # "Leaked 64 bytes at 0x7f..": the address varies between repeats; sizes stay (they tell errors apart).
    return re.sub(r"0x[0-9a-fA-F]+", "0x…", message)
