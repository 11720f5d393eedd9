// What each module of the library tells protocol/engine/fused.py when imported (fused.cpp's
// `_fused`, fused_cuda.cu's `_fused_cuda`): the hash of the sources it was built from, and
// whether it carries its own copy of the C++ standard library.

#pragma once

#include <Python.h>
#include <dlfcn.h>

#include <locale>

// The sha256 of the sources (this directory's), given by setup.py: fused.py refuses a module
// built from another version of them (an editable install whose rebuild failed keeps the old
// one).
#ifndef OVT_FUSED_SOURCE
#define OVT_FUSED_SOURCE "unknown"
#endif

namespace ovt {

// Whether this module's calls into the C++ standard library reach a copy linked into the
// module itself (a toolchain with libstdc++.a and no libstdc++.so links it statically, and a
// loader flag such as -Bsymbolic-functions binds the calls to it). That copy's streams then
// read a locale the process's own libstdc++ set up, perhaps of another release: seen on one
// machine (GCC 13's library in a process running GCC 14's), where formatting a failing
// TORCH_CHECK's message crashed the process instead of raising. fused.py refuses such a build.
// Where dladdr cannot place an address (never seen) the answer is no: the module is used.
// `static`: each module's own copy, at an address inside that module.
static bool own_standard_library() {
  Dl_info standard{}, self{};
  const auto classic = &std::locale::classic;
  const auto here = &own_standard_library;
  return dladdr(reinterpret_cast<void*>(classic), &standard) != 0 &&
         dladdr(reinterpret_cast<void*>(here), &self) != 0 &&
         standard.dli_fbase == self.dli_fbase;
}

// An importable Python module of `definition`, holding SOURCE and OWN_STANDARD_LIBRARY;
// nullptr, with the Python error set, where it cannot be made.
static PyObject* describe_module(PyModuleDef* definition) {
  PyObject* module = PyModule_Create(definition);
  if (module != nullptr &&
      (PyModule_AddStringConstant(module, "SOURCE", OVT_FUSED_SOURCE) < 0 ||
       PyModule_AddIntConstant(module, "OWN_STANDARD_LIBRARY", own_standard_library()) < 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

}  // namespace ovt
