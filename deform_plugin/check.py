"""``python -m deform_plugin check``: what deform_plugin found in this environment, and whether it can run here.

One line per part of the stack (deform_plugin itself, Python, torch and the GPU, Triton, mmcv, mmengine, mmdet, the
backend ``'auto'`` picks, the CPU thread settings), then one ``error:`` line per missing or unsupported requirement;
the exit status is 1 when there is any. Every answer comes from the code that acts on it: mmcv's compiled ops from
:func:`deform_plugin.integration.mmcv_lite.compiled_mmcv_ops_available`, Triton from
:func:`deform_plugin.ops.triton_support.triton_unavailable_reason`, the backend from
:func:`deform_plugin.ops.backend.resolve_backend`.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

# The versions deform_plugin supports (setup.py's install_requires; mmcv is not listed there because mmcv with its
# compiled ops and mmcv-lite both serve, which pip cannot express). Outside them something is known to break.
SUPPORTED = {
    "python": ((3, 9), None),
    "torch": ((2, 1), None),
    "triton": ((3, 0), None),
    "mmcv": ((2, 0, 0), (2, 2, 0)),  # mmdet 3.x refuses mmcv >= 2.2.0 at import
    "mmengine": ((0, 10), (1, 0)),
    "mmdet": ((3, 0), (3, 4)),
}
INSTALL_HINTS = {
    "torch": "install PyTorch first (pip install torch; see pytorch.org for CUDA builds)",
    "mmcv": "pip install mmcv-lite==2.1.0 (no compiler needed: deform_plugin stands in for its compiled ops), or "
            "mmcv 2.1.0 with its compiled ops",
    "mmengine": "pip install mmengine==0.10.7",
    "mmdet": "pip install --no-deps mmdet==3.3.0 (--no-deps: pip would otherwise try to build mmcv from source)",
    "triton": "pip install triton (the release that matches your torch)",
}


@dataclass
class Finding:
    """One line of the report; ``problem`` is set where something required is missing or unsupported."""

    name: str
    value: str
    problem: Optional[str] = None


def version_tuple(version: str) -> Tuple[int, ...]:
    """The release numbers of a version string: ``'2.13.0+cpu'`` -> ``(2, 13, 0)``, ``'2.0.0rc4'`` -> ``(2, 0, 0)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def range_problem(name: str, version: str) -> Optional[str]:
    """Why ``version`` of ``name`` is outside :data:`SUPPORTED`, or None."""
    low, high = SUPPORTED[name]
    found = version_tuple(version)
    if found < low:
        return f"{name} {version} is too old: deform_plugin needs {name} >= {'.'.join(map(str, low))}"
    if high is not None and found >= high:
        return f"{name} {version} is too new: deform_plugin supports {name} < {'.'.join(map(str, high))}"
    return None


def distribution_version(*names: str) -> Optional[Tuple[str, str]]:
    """(distribution name, version) of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def missing(name: str, required: bool = True) -> Finding:
    return Finding(name, "not installed", f"{name} is not installed: {INSTALL_HINTS[name]}" if required else None)


def plugin_finding() -> Finding:
    """deform_plugin's version, where it was imported from, and how it is installed there."""
    import deform_plugin

    location = os.path.dirname(os.path.abspath(deform_plugin.__file__))
    try:
        distribution = importlib.metadata.distribution("deform_plugin")
    except importlib.metadata.PackageNotFoundError:
        return Finding("deform_plugin", f"{deform_plugin.__version__} (not installed: imported from {location})")
    direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        installed_at = os.path.join(url_path(direct_url.get("url", "")), "deform_plugin")
        how = "editable install"
    else:
        installed_at = os.path.dirname(os.path.abspath(str(distribution.locate_file("deform_plugin/__init__.py"))))
        how = "installed"
    if os.path.realpath(installed_at) != os.path.realpath(location):
        # Python found another copy first (typically: run from a clone, whose folder comes first on sys.path).
        return Finding("deform_plugin", f"{deform_plugin.__version__} (imported from {location}; the {how} at "
                       f"{installed_at} is not the one in use)")
    return Finding("deform_plugin", f"{deform_plugin.__version__} ({how}, {location})")


def url_path(url: str) -> str:
    """The local path of a ``file://`` URL (pip's record of where an editable install points)."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(url).path)


def python_finding() -> Finding:
    version = platform.python_version()
    return Finding("python", f"{version} ({sys.executable})", range_problem("python", version))


def torch_findings() -> List[Finding]:
    if importlib.util.find_spec("torch") is None:
        return [missing("torch")]
    import torch

    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    findings = [Finding("torch", f"{torch.__version__} ({build})", range_problem("torch", torch.__version__))]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0)
        findings.append(Finding("GPU", f"{name}" + (f" (and {count - 1} more)" if count > 1 else "")))
    else:
        findings.append(Finding("GPU", "none (torch.cuda.is_available() is False)"))
    return findings


def triton_finding(device) -> Finding:
    from deform_plugin.ops.triton_support import triton_interpreter_enabled, triton_unavailable_reason

    found = distribution_version("triton", "pytorch-triton")
    if found is None:
        # The Triton kernels are what deform_plugin brings to a GPU; on a CPU the reference path runs without them.
        return missing("triton", required=device.type == "cuda")
    version = found[1]
    if device.type == "cuda":
        usage = "compiles the kernels for the GPU"
    elif triton_unavailable_reason(device) is None:
        usage = "interpreter (TRITON_INTERPRET is set): the kernels run on the CPU, slowly; meant for tests"
    else:
        usage = "not used here: no GPU (on a CPU the kernels run only in Triton's interpreter, TRITON_INTERPRET=1)"
    problem = range_problem("triton", version) if device.type == "cuda" or triton_interpreter_enabled() else None
    return Finding("triton", f"{version}: {usage}", problem)


def mmcv_finding() -> Finding:
    found = distribution_version("mmcv", "mmcv-lite", "mmcv-full")
    if found is None or importlib.util.find_spec("mmcv") is None:
        return missing("mmcv")
    distribution, version = found
    if distribution == "mmcv-full":
        return Finding("mmcv", f"mmcv-full {version}",
                       f"mmcv-full {version} is mmcv 1.x, for mmdet 2.x: {INSTALL_HINTS['mmcv']}")
    from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available, standin_installed

    if compiled_mmcv_ops_available():
        ops = "compiled ops (mmcv._ext) present: every mmcv op, and backend 'mmcv' for comparison"
    elif standin_installed():
        ops = ("no compiled ops; deform_plugin's stand-in serves MSDA, sigmoid focal loss and NMS (other mmcv ops "
               "raise NotImplementedError)")
    else:
        ops = "no compiled ops, and deform_plugin's stand-in is not installed"
    return Finding("mmcv", f"{distribution} {version}: {ops}", range_problem("mmcv", version))


def mmengine_finding() -> Finding:
    found = distribution_version("mmengine")
    if found is None or importlib.util.find_spec("mmengine") is None:
        return missing("mmengine")
    return Finding("mmengine", found[1], range_problem("mmengine", found[1]))


def mmdet_finding() -> Finding:
    """mmdet's version, and whether ``mmdet.models`` imports with deform_plugin's MSDA at its construction sites."""
    found = distribution_version("mmdet")
    if found is None or importlib.util.find_spec("mmdet") is None:
        return missing("mmdet")
    version = found[1]
    problem = range_problem("mmdet", version)
    if problem is not None:
        return Finding("mmdet", version, problem)
    try:
        import mmdet.models  # noqa: F401  (what a config's model needs; with mmcv-lite it needs the stand-in)
    except Exception as error:  # the report names it; a traceback would bury the answer
        return Finding("mmdet", version, f"mmdet.models does not import: {type(error).__name__}: {error}")
    from deform_plugin.integration.mmdet_msda_sites import MSDA_CONSTRUCTION_SITES, MSDA_GLOBAL_NAME
    from deform_plugin.models.msda import MultiScaleDeformableAttention

    sites = [sys.modules.get(name) for name in MSDA_CONSTRUCTION_SITES]
    ours = sum(getattr(site, MSDA_GLOBAL_NAME, None) is MultiScaleDeformableAttention for site in sites)
    if ours != len(sites):
        return Finding("mmdet", version, f"only {ours} of mmdet's {len(sites)} MSDA construction sites build "
                       "deform_plugin's module")
    return Finding("mmdet", f"{version}: mmdet.models imports; its MSDA layers build deform_plugin's module")


def backend_finding(device) -> Finding:
    from deform_plugin.ops.backend import BACKEND_ENV, get_default_backend, resolve_backend

    try:
        default = get_default_backend()
        chosen = resolve_backend("msda", None, device)
    except (ValueError, RuntimeError) as error:
        return Finding("backend", "cannot run", str(error))
    source = f" (from {BACKEND_ENV})" if os.environ.get(BACKEND_ENV, "").strip() else ""
    why = {"triton": "the fused Triton kernels", "pytorch": "the PyTorch reference", "mmcv": "mmcv's stock kernel"}
    return Finding("backend", f"{default!r}{source} runs MSDA on {device.type} with {chosen!r} "
                   f"({why.get(chosen, 'a registered backend')})")


def threads_finding() -> Finding:
    import torch

    from deform_plugin.cpu_threads import available_cpus

    settings = ", ".join(f"{name}={os.environ[name]}" if name in os.environ else f"{name} not set"
                         for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"))
    return Finding("CPU threads", f"torch uses {torch.get_num_threads()} of {available_cpus()} available CPUs; "
                   f"{settings}")


def environment_report() -> List[Finding]:
    """Every finding, in the order printed."""
    findings = [plugin_finding(), python_finding(), *torch_findings()]
    if any(f.name == "torch" and f.value == "not installed" for f in findings):
        return findings
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    findings += [triton_finding(device), mmcv_finding(), mmengine_finding()]
    openmmlab_ready = not any(f.problem for f in findings if f.name in ("mmcv", "mmengine"))
    findings.append(mmdet_finding() if openmmlab_ready else Finding("mmdet", "not checked (needs mmcv and mmengine)"))
    findings += [backend_finding(device), threads_finding()]
    return findings


def format_report(findings: List[Finding]) -> str:
    width = max(len(f.name) for f in findings)
    return "\n".join(f"{f.name:<{width}}  {f.value}" for f in findings)


def run_check() -> int:
    """Print the report; return 0 when deform_plugin can run here, 1 otherwise (each problem on stderr)."""
    findings = environment_report()
    print(format_report(findings), flush=True)
    problems = [f.problem for f in findings if f.problem]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print(f"deform_plugin cannot run here: {len(problems)} problem(s) above", file=sys.stderr)
        return 1
    print("ready: add custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False) to an mmdet config")
    return 0
