// pipecore._C -- native extension entry point.
//
// Keep the includes narrow: <torch/extension.h> pulls in all of ATen and the
// autograd API and costs ~20 s per translation unit. This file only needs
// pybind11 (torch's bundled copy, via torch's include path) and the
// header-only version macros.
#include <pybind11/pybind11.h>

#if defined(__has_include)
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#endif

#ifndef TORCH_EXTENSION_NAME
#error "TORCH_EXTENSION_NAME must be defined (set by torch.utils.cpp_extension or CMakeLists.txt)"
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict info;
#ifdef PIPECORE_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef PIPECORE_NVTX
  info["nvtx"] = true;
#else
  info["nvtx"] = false;
#endif
#ifdef TORCH_VERSION
  info["torch_version"] = py::str(TORCH_VERSION);
#else
  info["torch_version"] = py::str("");
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipecore native extension";
  m.def("build_info", &build_info,
        "Compile-time configuration of pipecore._C: "
        "{'cuda': bool, 'nvtx': bool, 'torch_version': str}.");
}
