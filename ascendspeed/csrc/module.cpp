// Python module entry of ascendspeed._C. Importing the module loads the shared library, whose
// static initialisers register every operator of the `ascendspeed` namespace with torch
// (see the TORCH_LIBRARY_FRAGMENT blocks beside each kernel).
#include <torch/extension.h>

TORCH_LIBRARY(ascendspeed, m) {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ascendspeed C++ operators; use them through ascendspeed.ops";
}
