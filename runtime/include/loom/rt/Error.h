//===- Error.h - Errors inside the runtime ----------------------*- C++ -*-===//
//
// Inside the runtime, failures throw loom::rt::Error; the C API catches them
// and returns a loom_status_t. Nothing here ends the process.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_ERROR_H
#define LOOM_RUNTIME_ERROR_H

#include "loom/runtime.h"

#include <sstream>
#include <stdexcept>
#include <string>

namespace loom::rt {

class Error : public std::runtime_error {
public:
  Error(loom_status_code_t code, const std::string &message)
      : std::runtime_error(message), code(code) {}
  loom_status_code_t code;
};

/// Builds a message from streamable parts.
template <typename... Args> std::string cat(const Args &...args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args> [[noreturn]] void fail(loom_status_code_t code, const Args &...args) {
  throw Error(code, cat(args...));
}

} // namespace loom::rt

#endif
