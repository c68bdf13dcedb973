"""``python -m dtorch_kernel install [...]`` installs the kernelspec; anything else launches
the kernel (that is how the kernelspec runs it: ``python -m dtorch_kernel -f CONN``)."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "install":
        from .install import main as install_main
        return install_main(argv[1:])
    from ipykernel.kernelapp import IPKernelApp

    from .kernel import DTorchKernel
    IPKernelApp.launch_instance(argv=argv, kernel_class=DTorchKernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
