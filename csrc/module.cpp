// The Python extension module flash_attn_ext._C. It holds no Python functions:
// importing it loads the shared library, whose static initialisers register
// the operators with torch's dispatcher (TORCH_LIBRARY in ops.cpp).
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "flash_attn_ext native operators (see torch.ops.flash_attn_ext)",
      -1, nullptr};
  return PyModule_Create(&module_def);
}
}
