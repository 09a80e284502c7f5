/* The CPython module shell around fp4_kernels.c: the package imports
 * k3convert.native._fp4_kernels like any extension module (found by the import system in
 * the installed package, never in a cache directory), and k3convert/native/__init__.py
 * then binds the kernels' exported C functions (k3_*) from the same loaded object through
 * ctypes. The module itself only carries the kernels' ABI number for that check. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int k3_fp4_kernels_version(void);

static struct PyModuleDef k3_fp4_module = {
    PyModuleDef_HEAD_INIT, "_fp4_kernels",
    "k3convert's FP4 byte kernels (see k3convert/native/fp4_kernels.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fp4_kernels(void) {
    PyObject *m = PyModule_Create(&k3_fp4_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", k3_fp4_kernels_version()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
