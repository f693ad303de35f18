// One mapping from pa2a::Error to Python exceptions, shared by every binding module.
//
// The exception classes are created once, in pcie_a2a._transport (always built); the other
// modules import them. Each module registers a *module-local* translator: pybind11 tries
// global translators of every loaded module in turn, so a global one in one module would
// decide how another module's errors surface (a timeout became RuntimeError that way).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

#include "core/exception.h"

namespace pa2a::bindings {

namespace py = pybind11;

struct ErrorClasses {
  py::handle peer, timeout, aborted;  // kept alive for the process lifetime
};

inline ErrorClasses& error_classes() {
  static ErrorClasses classes;  // one per module: bindings are built with hidden visibility
  return classes;
}

inline void translate_errors(py::handle peer, py::handle timeout, py::handle aborted) {
  error_classes() = ErrorClasses{peer.inc_ref(), timeout.inc_ref(), aborted.inc_ref()};
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pa2a::Error& e) {
      const ErrorClasses& c = error_classes();
      switch (e.kind()) {
        case pa2a::Error::Kind::kValue:
          PyErr_SetString(PyExc_ValueError, e.what());
          break;
        case pa2a::Error::Kind::kTimeout:
          PyErr_SetString(c.timeout.ptr(), e.what());
          break;
        case pa2a::Error::Kind::kAborted:
          PyErr_SetString(c.aborted.ptr(), e.what());
          break;
        case pa2a::Error::Kind::kPeer:
          PyErr_SetString(c.peer.ptr(), e.what());
          break;
        default:
          PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    }
  });
}

// For every module but _transport: the classes _transport created.
inline void translate_errors_like_transport() {
  py::module_ t = py::module_::import("pcie_a2a._transport");
  translate_errors(t.attr("PeerError"), t.attr("PeerTimeoutError"), t.attr("PeerAbortedError"));
}

}  // namespace pa2a::bindings
