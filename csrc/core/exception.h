// One exception type for the native library, and the throwing check macros.
//
// The library never calls exit() or abort(): a serving process must get a Python
// traceback, not a dead worker. Bindings translate Error::Kind into Python exception
// classes (ValueError, PeerTimeoutError, PeerError, PeerAbortedError, RuntimeError).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pa2a {

class Error : public std::runtime_error {
 public:
  enum class Kind { kValue, kTimeout, kPeer, kAborted, kRuntime };
  Error(Kind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace pa2a

#define PA2A_THROW(kind, ...) \
  throw ::pa2a::Error(::pa2a::Error::Kind::kind, ::pa2a::detail::concat(__VA_ARGS__))

// Invalid arguments from the caller: becomes ValueError.
#define PA2A_CHECK_ARG(cond, ...)                 \
  do {                                            \
    if (!(cond)) PA2A_THROW(kValue, __VA_ARGS__); \
  } while (0)

// Broken internal invariant: becomes RuntimeError with the location.
#define PA2A_HOST_ASSERT(cond)                                                               \
  do {                                                                                       \
    if (!(cond))                                                                             \
      PA2A_THROW(kRuntime, "pcie_a2a internal check failed: ", #cond, " at ", __FILE__, ":", \
                 __LINE__);                                                                  \
  } while (0)
