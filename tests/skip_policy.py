"""CI's rule for skips: a test may skip only for what this machine lacks and a test cannot
provide (issue 46, "no silent skips"). A skip for anything else, a test dependency that did not
import, a kernel module that was not interpreted, a file that is not in the checkout, fails a
CI run (``tests/conftest.py`` applies it when CI=true) after the summary has listed it.
"""

from __future__ import annotations

import re

# What a CI machine may lack: a GPU; a CPU or build capability the kernels probe for (native C
# kernels, a compiler, a torch build option, huge pages, objdump, a second kernel to compare);
# a browser for the UI check; a full git history. And the fresh-interpreter rerun of a kernel test
# file, which runs only where the kernels came compiled for a GPU (the same tests ran in-process).
MACHINE_LACKS = re.compile(
    r"\bCUDA\b|\bGPU\b|native|C compiler|torch build|oneDNN|MKL|int8pack|huge ?pages|MADV_HUGEPAGE|objdump"
    r"|route only|two kernels|Chromium|a git checkout|shallow clone|the kernel tests ran in this process",
    re.IGNORECASE)


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped test's report (pytest keeps ``(path, line, "Skipped: reason")``)."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def disallowed_skips(reasons: list[str]) -> list[str]:
    """The reasons CI does not accept (see the module docstring), in order."""
    return [r for r in reasons if not MACHINE_LACKS.search(r)]
