// Python module entry of ascendspeed._C. Importing the module loads the shared library, whose
// static initialisers register every operator of the `ascendspeed` namespace with torch: the
// TORCH_LIBRARY_FRAGMENT blocks beside each kernel make up the namespace.
//
// The library uses libtorch and CPython's stable ABI only (no pybind11, no libtorch_python): built once
// as `_C.abi3.so`, it serves every Python that has the same torch release (scripts/bootstrap.sh reuses
// it). This file includes no torch header, so it compiles in a second instead of a minute.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C", "ascendspeed C++ operators; use them through ascendspeed.ops", -1,
      nullptr,
  };
  return PyModule_Create(&module);
}
