"""Build step for the one compiled part: the FP4 byte kernels (k3convert/native).

Everything else about the package is declared in pyproject.toml. The kernels are a
CPython extension module so that they are built when the package is (a wheel carries
them; ``pip install`` from source compiles them with setuptools' compiler, which honours
``CC`` / ``CFLAGS`` / ``LDFLAGS``) and imported like any extension module: nothing is
compiled or loaded from a cache directory at run time. ``optional=True``: where no C
compiler works the install still succeeds and the kernels' callers take their torch path
(the same bytes, slower; ``k3convert --version`` says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "k3convert.native._fp4_kernels",
            sources=["k3convert/native/fp4_kernels.c", "k3convert/native/_fp4_module.c"],
            extra_compile_args=["-O3", "-std=c11", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
