"""The runtime's layering: the engine's bookkeeping (`runtime/core`) never needs torch."""

import subprocess
import sys


def test_core_imports_without_torch():
    code = (
        "import sys\n"
        "import trtedge.runtime.core.request, trtedge.runtime.core.scheduler\n"
        "import trtedge.runtime.core.block_manager, trtedge.runtime.core.hybrid_state\n"
        "import trtedge.runtime.core.speech\n"
        "assert 'torch' not in sys.modules, 'runtime/core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
