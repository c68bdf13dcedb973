"""DTorchKernel: an IPython kernel that hosts the dtorch controller.

It is ipykernel's ``IPythonKernel`` with the dtorch extension loaded into its shell (see
:mod:`dtorch_kernel.extension`), so every cell is followed by a flush, error reporting and
the collective summary, and ``%dtorch`` is available. The cluster is not started with the
kernel: the first DTensor op starts it, with a progress display. Shutting the kernel down
shuts the cluster down. Launched by the kernelspec as ``python -m dtorch_kernel -f CONN``.
"""

from __future__ import annotations

from ipykernel.ipkernel import IPythonKernel

import dtorch
from dtorch.runtime import session

from . import KERNEL_NAME
from .extension import load_ipython_extension

BANNER = ("dtorch kernel: single-controller distributed tensors. The cluster starts on the "
          "first DTensor op; %dtorch status | restart | counts on | counts off.")


class DTorchKernel(IPythonKernel):
    """IPython kernel + per-cell dtorch reporting."""

    implementation = KERNEL_NAME
    implementation_version = dtorch.__version__

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dtorch = load_ipython_extension(self.shell)

    @property
    def banner(self):  # type: ignore[override]
        base = self.shell.banner if self.shell else ""
        return f"{base}\n{BANNER}\n" if base else BANNER

    def do_shutdown(self, restart):
        try:
            session.shutdown()
        except Exception:  # noqa: BLE001 - the kernel is going away regardless
            pass
        return super().do_shutdown(restart)
