// A tiny extension for tests/test_cpp_build.py: Python's C API only, so it compiles in a second or two.
#include <Python.h>

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define INIT_(name) PyInit_##name
#define INIT(name) INIT_(name)

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }

static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, STRINGIFY(TORCH_EXTENSION_NAME), nullptr, -1, methods,
                                  nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
