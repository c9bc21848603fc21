"""Reading compute-sanitizer's output: samples written from its documented format (CUDA 11 and 12 layouts)."""
from deform_plugin.benchmarks.sanitizer.reports import grouped_findings, parse_sanitizer_output

CLEAN = """========= COMPUTE-SANITIZER
check msda:fp32 | L3x5 forward | 1.6e-07 | 0.0001 | ok
case msda:fp32: 13/13 checks passed in 2.1 s
========= ERROR SUMMARY: 0 errors
"""

# memcheck (CUDA 12 layout): two reports of one overrun in our kernel, one in a PyTorch kernel, an API error.
MEMCHECK = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at msda_forward_kernel+0x1b0 in /repo/deform_plugin/ops/msda/triton_kernels.py:128
=========     by thread (3,0,0) in block (1,0,0)
=========     Address 0x7f3c1e000410 is out of bounds
=========     and is 16 bytes after the nearest allocation at 0x7f3c1e000000 of size 1024 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2dfbef]
=========                in /lib/x86_64-linux-gnu/libcuda.so.1
=========
========= Invalid __global__ read of size 4 bytes
=========     at msda_forward_kernel+0x1b0 in /repo/deform_plugin/ops/msda/triton_kernels.py:128
=========     by thread (4,0,0) in block (1,0,0)
=========     Address 0x7f3c1e000414 is out of bounds
=========
========= Invalid __global__ write of size 2 bytes
=========     at void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::Half>, \
std::array<char *, 1>>(int, T2, T3)+0x2c0
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f3c1e100000 is out of bounds
=========
check msda:fp32 | L3x5 forward | 1.6e-07 | 0.0001 | ok
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaMemcpyAsync.
=========     Saved host backtrace up to driver entry point at error
=========     Host Frame: [0x33e1f5]
=========
========= ERROR SUMMARY: 4 errors
""".replace("\\\n", "")

# CUDA 11 layout: "at 0xOFFSET in FILE:LINE:KERNEL".
INITCHECK_OLD = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x00000150 in /repo/deform_plugin/ops/msda/triton_kernels.py:141:msda_backward_kernel
=========     by thread (31,0,0) in block (0,2,0)
=========     Address 0x7f0a40200000
=========
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at msda_backward_kernel+0x1a40 in /repo/k.py:300
=========     and Read access at msda_backward_kernel+0x1b20 in /repo/k.py:301 [128 hazards]
=========
========= Warning: Race reported between Read access at deform_sdpa_forward_kernel+0x90
=========     and Write access at deform_sdpa_forward_kernel+0xa0 [4 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
========= ERROR SUMMARY: 1 error
"""

# racecheck's hazard mode (--racecheck-report hazard), CUDA 11 layout.
RACECHECK_HAZARD = """========= ERROR: Potential WAW hazard detected at __shared__ 0x0 in block (0, 0, 0) :
=========     Write Thread (31, 0, 0) at 0x00000148 in raceWAW.cu:12:kernel()
=========     Write Thread (0, 0, 0) at 0x00000148 in raceWAW.cu:12:kernel()
=========     Current Value : 0, Incoming Value : 31
=========
========= ERROR SUMMARY: 1 error
"""


def test_a_clean_run_is_clean():
    report = parse_sanitizer_output(CLEAN)
    assert report.error_summary == 0 and report.findings == [] and report.clean


def test_memcheck_reports_name_their_kernels_and_api_calls():
    report = parse_sanitizer_output(MEMCHECK)
    assert report.error_summary == 4 and not report.clean
    assert [f.category for f in report.findings] == ["memory", "memory", "memory", "api"]
    first = report.findings[0]
    assert first.kernel == "msda_forward_kernel"
    assert first.location == "/repo/deform_plugin/ops/msda/triton_kernels.py:128"
    assert "is out of bounds" in " ".join(first.lines)
    assert report.findings[2].kernel.startswith("void at::native::vectorized_elementwise_kernel<4,")
    assert report.findings[2].kernel.endswith("(int, T2, T3)")
    assert report.findings[3].kernel == "API cudaMemcpyAsync"
    groups = grouped_findings(report.findings)
    assert groups[0] == dict(category="memory", kernel="msda_forward_kernel",
                             message="Invalid __global__ read of size 4 bytes", count=2)
    assert sum(group["count"] for group in groups) == 4 and len(groups) == 3


def test_the_older_layout_names_the_kernel_after_file_and_line():
    report = parse_sanitizer_output(INITCHECK_OLD)
    (finding,) = report.findings
    assert finding.category == "uninitialized" and finding.kernel == "msda_backward_kernel"
    assert finding.location == "/repo/deform_plugin/ops/msda/triton_kernels.py:141"
    assert report.error_summary == 1


def test_racecheck_errors_and_warnings_are_both_listed():
    report = parse_sanitizer_output(RACECHECK)
    assert [(f.category, f.kernel) for f in report.findings] == [("race", "msda_backward_kernel"),
                                                                  ("race", "deform_sdpa_forward_kernel")]
    assert report.findings[0].location == "/repo/k.py:300"
    # The warning is not in ERROR SUMMARY, but it is reported all the same: nothing is filtered.
    assert report.error_summary == 1 and report.race_summary.startswith("2 hazards displayed")
    hazard = parse_sanitizer_output(RACECHECK_HAZARD)
    assert [(f.category, f.kernel) for f in hazard.findings] == [("race", "kernel()")]


# compute-sanitizer 2025.3.1's racecheck (H200): a clean run, and a target that failed after four reports; neither
# prints ERROR SUMMARY.
RACECHECK_2025_CLEAN = """case msda:fp32: 39/39 checks passed in 5.4 s
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
RACECHECK_2025_FAILED = """========= Error: Race reported between Read access at nvjet_sm90_tst_64x48_TNT+0xab0
=========     and Write access at nvjet_sm90_tst_64x48_TNT+0xc10 [16 hazards]
=========
========= Error: process didn't terminate successfully
========= Target application returned an error
========= RACECHECK SUMMARY: 4 hazards displayed (4 errors, 0 warnings)
"""


def test_racecheck_without_error_summary_takes_its_error_count_from_the_race_summary():
    clean = parse_sanitizer_output(RACECHECK_2025_CLEAN)
    assert clean.error_summary == 0 and clean.clean
    failed = parse_sanitizer_output(RACECHECK_2025_FAILED)
    assert failed.error_summary == 4 and failed.application_failed and not failed.clean
    assert [(f.category, f.kernel) for f in failed.findings][0] == ("race", "nvjet_sm90_tst_64x48_TNT")
    # A race summary without an error count leaves the summary unknown: such a run is not called clean.
    assert parse_sanitizer_output("========= RACECHECK SUMMARY: cut\n").error_summary is None


def test_a_run_without_summary_is_not_clean():
    report = parse_sanitizer_output(MEMCHECK.split("========= ERROR SUMMARY")[0] + "Killed\n")
    assert report.error_summary is None and not report.clean and len(report.findings) == 4


def test_prefixed_lines_after_program_output_and_the_not_printed_summary():
    text = ("progress 50%========= Invalid __shared__ write of size 4 bytes\n"
            "=========     at msda_grad_value_segments_kernel+0x80\n"
            "========= Leaked 64 bytes at 0x7f0a40200000\n"
            "========= ERROR SUMMARY: 12000 errors\n"
            "========= ERROR SUMMARY: 2000 errors were not printed. Use --print-limit option to adjust the number\n")
    report = parse_sanitizer_output(text)
    assert report.error_summary == 12000
    assert [(f.category, f.kernel) for f in report.findings] == [("memory", "msda_grad_value_segments_kernel"),
                                                                  ("leak", None)]
    assert grouped_findings(report.findings)[1]["message"] == "Leaked 64 bytes at 0x…"


def test_the_failing_application_is_noted_not_counted_as_a_finding():
    report = parse_sanitizer_output("========= Target application returned an error\n"
                                    "========= ERROR SUMMARY: 0 errors\n")
    assert report.application_failed and report.findings == [] and report.clean
