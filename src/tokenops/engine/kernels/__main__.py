"""`python -m tokenops.engine.kernels`: build the native kernels now (what `make install` runs)."""

import sys
import time

from tokenops.engine.kernels import build_error, ops

t = time.perf_counter()
if ops() is None:
    print(f"native kernels not built: {build_error() or 'switched off (TOKENOPS_NATIVE_KERNELS=0)'}")
    sys.exit(0)  # the engine runs without them; install must not fail for it
print(f"native kernels ready ({time.perf_counter() - t:.1f} s)")
