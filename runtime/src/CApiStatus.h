//===- CApiStatus.h - Statuses of the C API ---------------------*- C++ -*-===//
//
// What the C API's files share: the status object and the guard that turns
// every exception into one, so that none crosses the C boundary.
//
//===----------------------------------------------------------------------===//
#ifndef LOOM_RUNTIME_CAPISTATUS_H
#define LOOM_RUNTIME_CAPISTATUS_H

#include "loom/runtime.h"
#include "loom/rt/Error.h"
#include "runtime/src/ThreadPool.h"

#include <new>
#include <string>

struct loom_status_t {
  loom_status_code_t code;
  std::string message;
};

namespace loom::rt::capi {

inline loom_status_t *makeStatus(loom_status_code_t code, std::string message) {
  return new (std::nothrow) loom_status_t{code, std::move(message)};
}

/// Runs `body`, turning every exception into a status.
template <typename F> loom_status_t *guarded(F body) {
  try {
    body();
    return nullptr;
  } catch (const Error &e) {
    return makeStatus(e.code, e.what());
  } catch (const std::bad_alloc &) {
    return makeStatus(LOOM_INVALID_ARGUMENT, "out of host memory");
  } catch (const std::exception &e) {
    return makeStatus(LOOM_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return makeStatus(LOOM_INTERNAL, "internal error: an exception that is not a std::exception");
  }
}

/// The CPU backend's thread count of an options struct: 0 (one per core) to kMaxThreads.
inline void checkNumThreads(int32_t n) {
  if (n < 0 || n > kMaxThreads)
    fail(LOOM_INVALID_ARGUMENT, "options.num_threads must be from 0 (one per core) to ", kMaxThreads, ", got ", n);
}

inline loom_status_t *nullArgument(const char *what) {
  return makeStatus(LOOM_INVALID_ARGUMENT, std::string(what) + " must not be NULL");
}

} // namespace loom::rt::capi

#endif
