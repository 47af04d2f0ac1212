#include "node_info.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <mutex>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace pipecore {

using torch::autograd::Node;

namespace {

// Per Python type of a node: its attributes that expose saved tensors (`_raw_saved_*`); and the
// C++ node types that save none, answered without Python.
std::mutex g_cache_mutex;
std::unordered_map<PyTypeObject*, std::vector<std::string>> g_saved_attrs;
std::unordered_set<std::type_index> g_saves_nothing;

std::vector<std::string> saved_attrs_of(py::handle obj) {
  std::vector<std::string> names;
  auto attrs = py::reinterpret_steal<py::list>(PyObject_Dir(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))));
  if (!attrs) throw py::error_already_set();
  for (const auto& name : attrs) {
    std::string s = py::str(name);
    if (s.rfind("_raw_saved_", 0) == 0) names.push_back(std::move(s));
  }
  return names;
}

bool hooked(py::handle value) {
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    for (const auto& item : value) {
      if (hooked(item)) return true;
    }
    return false;
  }
  if (value.is_none()) return false;
  try {
    return value.cast<const torch::autograd::SavedVariable&>().has_hooks();
  } catch (const py::cast_error&) {
    return true;  // not a SavedTensor as this torch exposes it: assume hooks (never re-run)
  }
}

}  // namespace

bool has_saved_tensor_hooks(Node* node) {
  const bool python = is_python_node(node);
  const std::type_index cpp_type(typeid(*node));
  if (!python) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    if (g_saves_nothing.count(cpp_type)) return false;
  }
  py::gil_scoped_acquire gil;
  py::object obj = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(node_ptr(node)));
  if (!obj) throw py::error_already_set();
  PyTypeObject* py_type = Py_TYPE(obj.ptr());
  std::vector<std::string> names;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);  // never held while Python runs
    auto it = g_saved_attrs.find(py_type);
    if ((cached = it != g_saved_attrs.end())) names = it->second;
  }
  if (!cached) {
    names = saved_attrs_of(obj);
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    g_saved_attrs.emplace(py_type, names);
    if (!python && names.empty()) g_saves_nothing.insert(cpp_type);
  }
  for (const auto& name : names) {
    if (hooked(py::getattr(obj, name.c_str(), py::none()))) return true;
  }
  return false;
}

bool is_compiled_graph(Node* node) {
  if (!is_python_node(node)) return false;
  py::gil_scoped_acquire gil;  // PyNode reads its Function's attributes
  return node->is_aot_backward();
}

std::string node_name(Node* node) {
  if (is_python_node(node)) return node->name();  // takes the GIL itself
  static std::mutex mutex;
  static std::unordered_map<std::type_index, std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, added] = names.try_emplace(std::type_index(typeid(*node)));
  if (added) it->second = node->name();
  return it->second;
}

}  // namespace pipecore
