"""The dtorch Jupyter kernel (installed as ``dtorch_kernel``)."""
