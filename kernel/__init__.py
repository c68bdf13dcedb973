"""The dtorch Jupyter kernel (installed as ``dtorch_kernel``).

An IPython kernel that hosts the dtorch controller. Install its kernelspec with::

    python -m dtorch_kernel install [--user | --sys-prefix | --prefix PATH]

and pick "dtorch (Python 3)" in Jupyter. After every cell the kernel flushes pending work,
shows worker errors as that cell's error and, when the cell issued collectives, one summary
line of them (``last_cell_records()`` returns the last cell's). ``%dtorch status | restart |
shutdown | counts on | counts off`` control it.

The same per-cell behaviour is available in any IPython session or plain ipykernel with
``%load_ext dtorch_kernel``. Modules (one concept each):

- :mod:`dtorch_kernel.kernel` - ``DTorchKernel``, the ``IPythonKernel`` subclass
- :mod:`dtorch_kernel.extension` - wires the pieces below into an IPython shell
- :mod:`dtorch_kernel.cell_report` - what happens after each cell
- :mod:`dtorch_kernel.summary` - the per-cell collective summary (text and HTML)
- :mod:`dtorch_kernel.magics` - ``%dtorch``
- :mod:`dtorch_kernel.progress` - the cluster start-up progress display
- :mod:`dtorch_kernel.worker_output` - worker stdout/stderr forwarded to the notebook
- :mod:`dtorch_kernel.install` - the kernelspec and ``python -m dtorch_kernel install``

This package imports nothing heavy at import time: worker processes import
:mod:`dtorch_kernel.worker_output` to unpickle its plugin.
"""

KERNEL_NAME = "dtorch"
DISPLAY_NAME = "dtorch (Python 3)"


def load_ipython_extension(ipython) -> None:
    """``%load_ext dtorch_kernel``: per-cell flush, errors, collective summary, ``%dtorch``."""
    from .extension import load_ipython_extension as load
    load(ipython)


def last_cell_records(shell=None):
    """The collectives (CommRecords) of the last cell that finished, or None outside the
    dtorch kernel. ``dtorch_widgets.CommView()`` shows them."""
    from .extension import last_cell_records as last
    return last(shell)


def unload_ipython_extension(ipython) -> None:
    from .extension import unload_ipython_extension as unload
    unload(ipython)
