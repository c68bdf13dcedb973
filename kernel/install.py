"""The ``dtorch`` kernelspec and ``python -m dtorch_kernel install``.

::

    python -m dtorch_kernel install               # --sys-prefix inside a virtualenv, else --user
    python -m dtorch_kernel install --user        # ~/.local/share/jupyter/kernels/dtorch
    python -m dtorch_kernel install --sys-prefix  # <sys.prefix>/share/jupyter/kernels/dtorch
    python -m dtorch_kernel install --prefix /tmp/p   # /tmp/p/share/jupyter/kernels/dtorch

The kernelspec runs this interpreter (``sys.executable``) with ``-m dtorch_kernel``. Example::

    >>> spec = kernel_spec("/usr/bin/python3")
    >>> spec["argv"][:3], spec["display_name"]
    (['/usr/bin/python3', '-m', 'dtorch_kernel'], 'dtorch (Python 3)')
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from . import DISPLAY_NAME, KERNEL_NAME


def kernel_spec(python: str | None = None, display_name: str = DISPLAY_NAME) -> dict:
    """The kernel.json content."""
    return {
        "argv": [python or sys.executable, "-m", "dtorch_kernel", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }


def in_virtualenv() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix)


def install(user: bool = False, sys_prefix: bool = False, prefix: str | None = None,
            name: str = KERNEL_NAME, display_name: str = DISPLAY_NAME,
            python: str | None = None) -> str:
    """Install the kernelspec; returns the directory it went to. With no location given:
    ``sys_prefix`` inside a virtualenv, else ``user``."""
    from jupyter_client.kernelspec import KernelSpecManager
    if sum(bool(x) for x in (user, sys_prefix, prefix)) > 1:
        raise ValueError("give at most one of user=, sys_prefix=, prefix=")
    if not (user or sys_prefix or prefix):
        sys_prefix, user = in_virtualenv(), not in_virtualenv()
    if sys_prefix:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # the spec dir is copied with these permissions
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(kernel_spec(python, display_name), f, indent=1)
        return KernelSpecManager().install_kernel_spec(tmp, kernel_name=name, user=user,
                                                       prefix=prefix)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtorch_kernel install",
        description="Install the dtorch Jupyter kernelspec (kernel name 'dtorch').")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true",
                       help="install for the current user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true",
                       help=f"install into this Python's prefix ({sys.prefix})")
    where.add_argument("--prefix", metavar="PATH",
                       help="install into PATH/share/jupyter/kernels (use with JUPYTER_PATH)")
    parser.add_argument("--name", default=KERNEL_NAME, help="kernelspec name (default: dtorch)")
    parser.add_argument("--display-name", default=DISPLAY_NAME,
                        help=f"name shown in Jupyter (default: {DISPLAY_NAME!r})")
    args = parser.parse_args(argv)
    path = install(user=args.user, sys_prefix=args.sys_prefix, prefix=args.prefix,
                   name=args.name, display_name=args.display_name)
    print(f"Installed kernelspec {args.name} ({args.display_name!r}) in {path}")
    return 0
